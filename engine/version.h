// The binary's version: the project version and the git revision it was built
// from ("0.1.0+g1a2b3c4d5e6f", "-dirty" with uncommitted changes, "+nogit"
// from a tree without git). Ranks of one job compare it at start
// (engine/preflight.h), so a stale binary on one node cannot join a run.
#pragma once

namespace origami {

const char* version();

}  // namespace origami
