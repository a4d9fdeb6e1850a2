// cuBLAS and cuBLASLt, loaded on first use. Linking libcublas maps
// libcublasLt at process start, and the dynamic loader's relocation of its
// tables touches ~211 MB of private pages (measured: an empty program linked
// against it peaks at 211 MB RSS). Every CPU rank and every host-only
// subcommand (`origami imbalance`, `plan`, ...) would pay that. So kernels/
// does not link cuBLAS: the first CUDA context dlopen()s both libraries and
// resolves the entry points the backend calls, all of them listed here.
//
// Invariant: backend code calls cuBLAS and cuBLASLt only through cublas(); a
// new call gets its pointer here (the build fails otherwise: neither library
// is linked). cuBLASLt returns cublasStatus_t too, so CUBLAS_CHECK covers it.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>

namespace origami::cuda {

struct CublasLibrary {
  // libcublas.so.<major>
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  decltype(&cublasGemmGroupedBatchedEx) gemm_grouped_batched_ex = nullptr;
  // libcublasLt.so.<major>
  decltype(&cublasLtCreate) lt_create = nullptr;
  decltype(&cublasLtDestroy) lt_destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) lt_matmul_desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) lt_matmul_desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) lt_matmul_desc_set_attribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) lt_matrix_layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) lt_matrix_layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) lt_preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) lt_preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) lt_preference_set_attribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) lt_algo_get_heuristic = nullptr;
  decltype(&cublasLtMatmul) lt_matmul = nullptr;
};

// Loads libcublas.so.<major> and libcublasLt.so.<major> once (thread-safe)
// from the toolkit the build used, else the loader's search path; an
// internal error naming the library and dlerror() when it or an entry point
// is missing.
const CublasLibrary& cublas();
// Whether cublas() has loaded them (tests: nothing maps them before first use).
bool cublas_loaded();

}  // namespace origami::cuda
