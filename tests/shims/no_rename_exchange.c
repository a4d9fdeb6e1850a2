// LD_PRELOAD shim for tests: renameat2 fails with EINVAL, as on file systems
// without RENAME_EXCHANGE (NFS), so a checkpoint re-save takes the path that
// moves the old step directory aside (engine/checkpoint.cpp, publish_step_dir).
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>

int renameat2(int olddirfd, const char* oldpath, int newdirfd, const char* newpath, unsigned int flags) {
  (void)olddirfd, (void)oldpath, (void)newdirfd, (void)newpath, (void)flags;
  errno = EINVAL;
  return -1;
}
