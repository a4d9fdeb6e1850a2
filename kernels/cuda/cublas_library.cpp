// cuBLAS loaded on first use (see cublas_library.h).
#include "kernels/cuda/cublas_library.h"

#include <dlfcn.h>

#include <atomic>
#include <type_traits>
#include <string>

#include "kernels/check.h"

namespace origami::cuda {

namespace {

std::atomic<bool> loaded{false};

CublasLibrary load() {
  const std::string name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = nullptr;
#ifdef ORIGAMI_CUDA_LIBRARY_DIR
  lib = dlopen((std::string(ORIGAMI_CUDA_LIBRARY_DIR) + "/" + name).c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
  if (!lib) lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  ORIGAMI_CHECK(lib != nullptr, "cannot load ", name, " (the CUDA toolkit's cuBLAS): ", dlerror());
  CublasLibrary api;
  auto resolve = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    ORIGAMI_CHECK(fn != nullptr, name, " has no ", symbol, ": ", dlerror());
  };
  resolve(api.create, "cublasCreate_v2");
  resolve(api.destroy, "cublasDestroy_v2");
  resolve(api.set_stream, "cublasSetStream_v2");
  resolve(api.status_name, "cublasGetStatusName");
  resolve(api.status_string, "cublasGetStatusString");
  loaded = true;
  return api;  // the library stays loaded for the process
}

}  // namespace

const CublasLibrary& cublas() {
  static const CublasLibrary api = load();
  return api;
}

bool cublas_loaded() { return loaded; }

}  // namespace origami::cuda
