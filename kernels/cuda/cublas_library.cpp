// cuBLAS and cuBLASLt loaded on first use (see cublas_library.h).
#include "kernels/cuda/cublas_library.h"

#include <dlfcn.h>

#include <atomic>
#include <string>
#include <type_traits>

#include "kernels/check.h"

namespace origami::cuda {

namespace {

std::atomic<bool> loaded{false};

// `name` from the build's toolkit directory, else the loader's search path.
// libcublas depends on libcublasLt, so the second open finds the copy the
// first one mapped (same soname) and maps nothing new.
void* open_library(const std::string& name) {
  void* lib = nullptr;
#ifdef ORIGAMI_CUDA_LIBRARY_DIR
  lib = dlopen((std::string(ORIGAMI_CUDA_LIBRARY_DIR) + "/" + name).c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
  if (!lib) lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  ORIGAMI_CHECK(lib != nullptr, "cannot load ", name, " (the CUDA toolkit's cuBLAS): ", dlerror());
  return lib;
}

CublasLibrary load() {
  const std::string blas_name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  const std::string lt_name = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* blas = open_library(blas_name);
  void* lt = open_library(lt_name);
  CublasLibrary api;
  auto resolve = [](void* lib, const std::string& name, auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    ORIGAMI_CHECK(fn != nullptr, name, " has no ", symbol, ": ", dlerror());
  };
  resolve(blas, blas_name, api.create, "cublasCreate_v2");
  resolve(blas, blas_name, api.destroy, "cublasDestroy_v2");
  resolve(blas, blas_name, api.set_stream, "cublasSetStream_v2");
  resolve(blas, blas_name, api.set_workspace, "cublasSetWorkspace_v2");
  resolve(blas, blas_name, api.status_name, "cublasGetStatusName");
  resolve(blas, blas_name, api.status_string, "cublasGetStatusString");
  resolve(blas, blas_name, api.gemm_grouped_batched_ex, "cublasGemmGroupedBatchedEx");
  resolve(lt, lt_name, api.lt_create, "cublasLtCreate");
  resolve(lt, lt_name, api.lt_destroy, "cublasLtDestroy");
  resolve(lt, lt_name, api.lt_matmul_desc_create, "cublasLtMatmulDescCreate");
  resolve(lt, lt_name, api.lt_matmul_desc_destroy, "cublasLtMatmulDescDestroy");
  resolve(lt, lt_name, api.lt_matmul_desc_set_attribute, "cublasLtMatmulDescSetAttribute");
  resolve(lt, lt_name, api.lt_matrix_layout_create, "cublasLtMatrixLayoutCreate");
  resolve(lt, lt_name, api.lt_matrix_layout_destroy, "cublasLtMatrixLayoutDestroy");
  resolve(lt, lt_name, api.lt_preference_create, "cublasLtMatmulPreferenceCreate");
  resolve(lt, lt_name, api.lt_preference_destroy, "cublasLtMatmulPreferenceDestroy");
  resolve(lt, lt_name, api.lt_preference_set_attribute, "cublasLtMatmulPreferenceSetAttribute");
  resolve(lt, lt_name, api.lt_algo_get_heuristic, "cublasLtMatmulAlgoGetHeuristic");
  resolve(lt, lt_name, api.lt_matmul, "cublasLtMatmul");
  loaded = true;
  return api;  // the libraries stay loaded for the process
}

}  // namespace

const CublasLibrary& cublas() {
  static const CublasLibrary api = load();
  return api;
}

bool cublas_loaded() { return loaded; }

}  // namespace origami::cuda
