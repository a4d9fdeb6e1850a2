// CUDA rotary position embedding (kernels/rope.h), rotate-half, in place on
// x [B, S, H, hd] of f32 or bf16; positions i32 [S].
//
// Angles as the CPU twin forms them: inv_freq = θ^(−2i/hd) and pos · inv_freq
// in double, cos/sin in double (the precise device functions, not the
// intrinsics), each rounded once to float. CUDA's double pow/sin/cos are
// within 2 ulp of glibc's, so a table entry differs from the CPU's by at most
// one float ulp, and only when the double value sits next to a float rounding
// boundary. The rotation is the CPU's expressions with the FMAs GCC contracts
// them into: x'_lo = fmaf(a, cos, −(c·sin)), x'_hi = fmaf(c, cos, a·sin).
//
// Grid (S, batch groups), 256 threads: a block builds the cos/sin table of
// its position in shared memory once, then rotates every head of its batch
// rows, 8-element packs of each half when hd % 16 == 0 and x is 16-byte
// aligned (every row and half then starts aligned), else scalar.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/pack.cuh"

namespace origami::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxHalf = 512;       // the CPU twin's limit on hd / 2
constexpr int64_t kMinBlocks = 1024;    // positions × batch groups, when B allows

template <class T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(T* x, const int32_t* __restrict__ pos, double theta, double sign, int64_t B, int64_t S, int64_t H,
                int64_t hd, bool packed) {
  __shared__ float cs[kMaxHalf], sn[kMaxHalf];
  const int64_t s = blockIdx.x, half = hd / 2;
  const double p = static_cast<double>(pos[s]);
  for (int64_t i = threadIdx.x; i < half; i += kThreads) {
    const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
    const double angle = p * inv_freq;
    cs[i] = static_cast<float>(cos(angle));
    sn[i] = static_cast<float>(sign * sin(angle));
  }
  __syncthreads();
  const int64_t pairs = H * half;  // (head, i) per batch row
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    T* row = x + (b * S + s) * H * hd;
    if (packed) {
      const int64_t packs_per_head = half / kPack;
      for (int64_t j = threadIdx.x; j < pairs / kPack; j += kThreads) {
        const int64_t h = j / packs_per_head, i = (j - h * packs_per_head) * kPack;
        T* lo = row + h * hd + i;
        T* hi = lo + half;
        float a[kPack], c[kPack], lo_out[kPack], hi_out[kPack];
        load_pack(lo, a);
        load_pack(hi, c);
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          lo_out[k] = fmaf(a[k], cs[i + k], -(c[k] * sn[i + k]));
          hi_out[k] = fmaf(c[k], cs[i + k], a[k] * sn[i + k]);
        }
        store_pack(lo, lo_out);
        store_pack(hi, hi_out);
      }
    } else {
      for (int64_t j = threadIdx.x; j < pairs; j += kThreads) {
        const int64_t h = j / half, i = j - h * half;
        T* lo = row + h * hd + i;
        T* hi = lo + half;
        const float a = to_f32(*lo), c = to_f32(*hi);
        *lo = from_f32<T>(fmaf(a, cs[i], -(c * sn[i])));
        *hi = from_f32<T>(fmaf(c, cs[i], a * sn[i]));
      }
    }
  }
}

// sign = +1 rotates by +angle (forward), −1 by −angle (the inverse and the
// adjoint: a rotation matrix is orthogonal).
void rotate(const ExecContext& ctx, Tensor& x_BSHd, const Tensor& pos_S, float theta, double sign, const char* what) {
  ORIGAMI_CHECK(x_BSHd.defined() && x_BSHd.dim() == 4 && is_float_data(x_BSHd.dtype()), what,
                " expects an f32 or bf16 [B, S, H, hd] tensor, got ",
                x_BSHd.defined() ? shape_string(x_BSHd.shape()) : std::string("an undefined tensor"));
  const int64_t B = x_BSHd.size(0), S = x_BSHd.size(1), H = x_BSHd.size(2), hd = x_BSHd.size(3);
  ORIGAMI_CHECK(hd % 2 == 0 && hd / 2 <= kMaxHalf, what, " head_dim ", hd, " must be even and <= ", 2 * kMaxHalf);
  ORIGAMI_CHECK(pos_S.defined(), what, " positions are undefined");
  check_shape(pos_S, {S}, "rope positions");
  ORIGAMI_CHECK(pos_S.dtype() == DType::i32, "rope positions must be i32");
  ORIGAMI_CHECK(theta > 0.0f, what, " theta must be positive, got ", theta);
  if (x_BSHd.numel() == 0) return;
  ORIGAMI_CHECK(S <= 0x7FFFFFFF, what, " sequence length ", S, " exceeds the grid");
  const int64_t groups = std::min<int64_t>(B, std::min<int64_t>(65535, (kMinBlocks + S - 1) / S));
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(groups));
  with_data_type(x_BSHd.dtype(), [&]<class T>() {
    T* x = dev<T>(x_BSHd, "x_BSHd");
    const bool packed = hd % (2 * kPack) == 0 && aligned16(x);
    rope_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(x, dev<const int32_t>(pos_S, "pos_S"),
                                                          static_cast<double>(theta), sign, B, S, H, hd, packed);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void rope_forward(const ExecContext& ctx, Tensor& x_BSHd, const Tensor& pos_S, float theta) {
  rotate(ctx, x_BSHd, pos_S, theta, 1.0, "rope_forward");
}

void rope_backward(const ExecContext& ctx, Tensor& dx_BSHd, const Tensor& pos_S, float theta) {
  rotate(ctx, dx_BSHd, pos_S, theta, -1.0, "rope_backward");
}

}  // namespace origami::cuda
