// The dispatch's device rule (kernels/dispatch.cpp): every tensor of an op
// call lives on the context's device; the op then runs on that device's
// backend. Exposed for its tests.
#pragma once
#include <initializer_list>
#include <string>

#include "kernels/context.h"

namespace origami {

struct OpArg {
  const char* name;
  const Tensor* tensor;  // undefined tensors (optional inputs) are skipped
};

struct NamedDevice {
  const char* name;
  Device device;
};

// "" when every argument is on `device`, else the rule broken, naming the
// op, the context's device and each argument elsewhere:
// "gemm: the context runs on cpu but B is on cuda:0".
std::string device_mismatch(const char* op, Device device, std::initializer_list<NamedDevice> args);
std::string device_mismatch(const char* op, Device device, std::initializer_list<OpArg> args);

}  // namespace origami
