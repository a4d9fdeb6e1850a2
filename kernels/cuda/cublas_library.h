// cuBLAS, loaded on first use. Linking libcublas maps libcublasLt at process
// start, and the dynamic loader's relocation of its tables touches ~211 MB
// of private pages (measured: an empty program linked against it peaks at
// 211 MB RSS). Every CPU rank and every host-only subcommand (`origami
// imbalance`, `plan`, ...) would pay that. So kernels/ does not link cuBLAS:
// the first CUDA context dlopen()s it and resolves the entry points the
// backend calls, all of them listed here.
//
// Invariant: backend code calls cuBLAS only through cublas(); a new cuBLAS
// call gets its pointer here (the build fails otherwise: the library is not
// linked).
#pragma once
#include <cublas_v2.h>

namespace origami::cuda {

struct CublasLibrary {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

// Loads libcublas.so.<major> once (thread-safe) from the toolkit the build
// used, else the loader's search path; an internal error naming the library
// and dlerror() when it or an entry point is missing.
const CublasLibrary& cublas();
// Whether cublas() has loaded it (tests: nothing maps it before first use).
bool cublas_loaded();

}  // namespace origami::cuda
