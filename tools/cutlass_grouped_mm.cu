// CUTLASS sm90 ptr-array grouped GEMMs (bf16 in and out, FP32 accumulation), group sizes on
// the device: D[rows of g] = A[rows of g] @ B[g]^T with A [R, K] row-major, B [G, N, K]
// K-major, offsets[g] the cumulative end of group g (int32). A comparison tool for
// tools/bench_cutlass_grouped_mm.py (built there with nvcc), not part of a package.
// One small kernel turns the offsets into per-group shapes and pointers, so no call
// reads the group sizes on the host; strides are the same for every group and are
// uploaded once per (G, N, K).
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using Elem = cutlass::bfloat16_t;
using Acc = float;

template <class Tile, class Cluster, class KSched, class ESched>
struct Grouped {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int Align = 8;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, Elem, LayoutD*, Align, Elem,
      LayoutD*, Align, ESched, cutlass::epilogue::fusion::LinearCombination<Elem, Acc>>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, LayoutA*, Align, Elem, LayoutB*, Align,
      Acc, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Tile, class Cluster>
using PP = Grouped<Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                   cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
template <class Tile, class Cluster>
using CO = Grouped<Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                   cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

using Shape3 = typename ProblemShape::UnderlyingProblemShape;

__global__ void fill_groups(const int* offsets, int G, int N, int K, const Elem* A, const Elem* B,
                            Elem* D, Shape3* shapes, const Elem** pa, const Elem** pb,
                            const Elem** pc, Elem** pd) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= G) return;
  int start = g ? offsets[g - 1] : 0;
  int m = offsets[g] - start;
  shapes[g] = Shape3(m, N, K);
  pa[g] = A + (int64_t)start * K;
  pb[g] = B + (int64_t)g * N * K;
  pc[g] = D + (int64_t)start * N;
  pd[g] = D + (int64_t)start * N;
}

template <class Cfg>
struct Runner {
  using Gemm = typename Cfg::Gemm;
  using SA = typename Gemm::GemmKernel::InternalStrideA;
  using SB = typename Gemm::GemmKernel::InternalStrideB;
  using SC = typename Gemm::GemmKernel::InternalStrideC;
  using SD = typename Gemm::GemmKernel::InternalStrideD;
  int G = -1, N = -1, K = -1;
  void* scratch = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  Gemm gemm;

  int run(const void* A, const void* B, void* D, const int* offsets, int G_, int N_, int K_,
          cudaStream_t stream) {
    // scratch: per-group shapes, 4 pointer arrays, 4 stride arrays
    size_t sz = G_ * (sizeof(Shape3) + 4 * sizeof(void*) + sizeof(SA) + sizeof(SB) + sizeof(SC) + sizeof(SD)) + 1024;
    if (G_ != G || N_ != N || K_ != K) {
      if (scratch) cudaFree(scratch);
      cudaMalloc(&scratch, sz);
      G = G_; N = N_; K = K_;
      std::vector<SA> sa(G, cutlass::make_cute_packed_stride(SA{}, cute::make_shape(1, K, 1)));
      std::vector<SB> sb(G, cutlass::make_cute_packed_stride(SB{}, cute::make_shape(N, K, 1)));
      std::vector<SC> sc(G, cutlass::make_cute_packed_stride(SC{}, cute::make_shape(1, N, 1)));
      std::vector<SD> sd(G, cutlass::make_cute_packed_stride(SD{}, cute::make_shape(1, N, 1)));
      char* p = (char*)scratch + G * (sizeof(Shape3) + 4 * sizeof(void*));
      cudaMemcpy(p, sa.data(), G * sizeof(SA), cudaMemcpyHostToDevice); p += G * sizeof(SA);
      cudaMemcpy(p, sb.data(), G * sizeof(SB), cudaMemcpyHostToDevice); p += G * sizeof(SB);
      cudaMemcpy(p, sc.data(), G * sizeof(SC), cudaMemcpyHostToDevice); p += G * sizeof(SC);
      cudaMemcpy(p, sd.data(), G * sizeof(SD), cudaMemcpyHostToDevice);
    }
    char* p = (char*)scratch;
    Shape3* shapes = (Shape3*)p; p += G * sizeof(Shape3);
    const Elem** pa = (const Elem**)p; p += G * sizeof(void*);
    const Elem** pb = (const Elem**)p; p += G * sizeof(void*);
    const Elem** pc = (const Elem**)p; p += G * sizeof(void*);
    Elem** pd = (Elem**)p; p += G * sizeof(void*);
    SA* sa = (SA*)p; p += G * sizeof(SA);
    SB* sb = (SB*)p; p += G * sizeof(SB);
    SC* sc = (SC*)p; p += G * sizeof(SC);
    SD* sd = (SD*)p;
    fill_groups<<<(G + 127) / 128, 128, 0, stream>>>(offsets, G, N, K, (const Elem*)A, (const Elem*)B,
                                                     (Elem*)D, shapes, pa, pb, pc, pd);
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {G, shapes, nullptr},
                                  {pa, sa, pb, sb},
                                  {{}, pc, sc, pd, sd},
                                  hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
    size_t ws = Gemm::get_workspace_size(args);
    if (ws > workspace_bytes) {
      if (workspace) cudaFree(workspace);
      cudaMalloc(&workspace, ws);
      workspace_bytes = ws;
    }
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
    return 0;
  }
};

// The variants, in the order of VARIANTS in the Python tool.
static Runner<PP<Shape<_128, _128, _64>, Shape<_2, _1, _1>>> v0;
static Runner<CO<Shape<_256, _128, _64>, Shape<_2, _1, _1>>> v1;
static Runner<PP<Shape<_128, _128, _64>, Shape<_1, _1, _1>>> v2;
static Runner<PP<Shape<_128, _128, _64>, Shape<_1, _2, _1>>> v3;
static Runner<CO<Shape<_128, _256, _64>, Shape<_2, _1, _1>>> v4;
static Runner<CO<Shape<_256, _128, _64>, Shape<_1, _1, _1>>> v5;

extern "C" int gg_run(int variant, const void* A, const void* B, void* D, const int* offsets, int G,
                      int N, int K, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  switch (variant) {
    case 0: return v0.run(A, B, D, offsets, G, N, K, s);
    case 1: return v1.run(A, B, D, offsets, G, N, K, s);
    case 2: return v2.run(A, B, D, offsets, G, N, K, s);
    case 3: return v3.run(A, B, D, offsets, G, N, K, s);
    case 4: return v4.run(A, B, D, offsets, G, N, K, s);
    default: return v5.run(A, B, D, offsets, G, N, K, s);
  }
}
