// oneDNN GEMMs as XLA:CPU FFI custom calls, for benchmarks/gemm_chain.py only (a measurement:
// what routing the model's bf16 GEMMs through oneDNN would buy; not used by the engine).
//
// vit22b_packed_bytes(m, k, n): bytes of a [k, n] bf16 weight in oneDNN's own blocked layout.
// Pack: a [k, n] bf16 weight -> that layout (once, as an engine would at load).
// MatmulF32 / MatmulBf16: x [..., k] bf16 times w (plain [k, n], or packed) -> y [..., n], f32
// accumulation, output f32 or bf16; "gelu" fuses an exact GELU into the output (a post-op).
// MatmulBiasGeluBf16: x w + bias [n] (f32), the exact GELU, bf16 out.
// Each calling thread keeps its own stream and primitives (XLA:CPU runs each emulated device on
// its own threads); "threads" sets the OpenMP threads of the call.
#include <omp.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <unordered_map>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

namespace {

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

dnnl::matmul::primitive_desc describe(int64_t m, int64_t k, int64_t n, bool packed, dt out,
                                      bool gelu, bool bias = false) {
  dnnl::memory::desc a({m, k}, dt::bf16, tag::ab), c({m, n}, out, tag::ab);
  dnnl::memory::desc b({k, n}, dt::bf16, packed ? tag::any : tag::ab);
  dnnl::memory::desc bias_md({1, n}, dt::f32, tag::ab);
  dnnl::primitive_attr attr;
  if (gelu) {
    dnnl::post_ops ops;
#if DNNL_VERSION_MAJOR >= 3
    ops.append_eltwise(dnnl::algorithm::eltwise_gelu_erf, 0.f, 0.f);
#else
    ops.append_eltwise(1.f, dnnl::algorithm::eltwise_gelu_erf, 0.f, 0.f);
#endif
    attr.set_post_ops(ops);
  }
#if DNNL_VERSION_MAJOR >= 3
  if (bias) return dnnl::matmul::primitive_desc(engine(), a, b, bias_md, c, attr);
  return dnnl::matmul::primitive_desc(engine(), a, b, c, attr);
#else
  if (bias) {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, bias_md, c), attr, engine());
  }
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine());
#endif
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Context {
  dnnl::stream stream{engine()};
  std::map<Key, dnnl::matmul::primitive_desc> descs;
  std::map<Key, dnnl::matmul> primitives;
};

Context& context() {
  thread_local Context ctx;
  return ctx;
}

ffi::Error Pack(ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::U8> out, int64_t m) {
  auto d = w.dimensions();
  int64_t k = d[0], n = 1;
  for (size_t i = 1; i < d.size(); ++i) n *= d[i];
  auto pd = describe(m, k, n, true, dt::f32, false);
  dnnl::memory src({{k, n}, dt::bf16, tag::ab}, engine(), w.untyped_data());
  dnnl::memory dst(pd.weights_desc(), engine(), out->untyped_data());
  dnnl::reorder(src, dst).execute(context().stream, src, dst);
  context().stream.wait();
  return ffi::Error::Success();
}

template <ffi::DataType T>
ffi::Error Run(ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer w, const float* bias,
               ffi::ResultBuffer<T> y, int64_t n, int64_t threads, int64_t packed,
               int64_t packed_m, int64_t gelu) {
  auto xd = x.dimensions();
  int64_t k = xd.back(), m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) m *= xd[i];
  const dt out = T == ffi::DataType::F32 ? dt::f32 : dt::bf16;
  omp_set_num_threads(static_cast<int>(threads));
  Context& ctx = context();
  const bool has_bias = bias != nullptr;
  Key key{m, k, n, threads, packed, gelu * 2 + has_bias, static_cast<int64_t>(out)};
  auto found = ctx.primitives.find(key);
  if (found == ctx.primitives.end()) {
    auto pd = describe(m, k, n, packed, out, gelu, has_bias);
    if (packed && pd.weights_desc() != describe(packed_m, k, n, true, dt::f32, false)
                                           .weights_desc()) {
      return ffi::Error::Internal("the packed layout differs at this row count");
    }
    ctx.descs.emplace(key, pd);
    found = ctx.primitives.emplace(key, dnnl::matmul(pd)).first;
  }
  const auto& pd = ctx.descs.at(key);
  dnnl::memory a({{m, k}, dt::bf16, tag::ab}, engine(), x.untyped_data());
  dnnl::memory b(pd.weights_desc(), engine(), w.untyped_data());
  dnnl::memory c({{m, n}, out, tag::ab}, engine(), y->untyped_data());
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
  if (has_bias) {
    args.emplace(DNNL_ARG_BIAS, dnnl::memory({{1, n}, dt::f32, tag::ab}, engine(),
                                             const_cast<float*>(bias)));
  }
  found->second.execute(ctx.stream, args);
  ctx.stream.wait();
  return ffi::Error::Success();
}

template <ffi::DataType T>
ffi::Error Matmul(ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer w, ffi::ResultBuffer<T> y, int64_t n,
                  int64_t threads, int64_t packed, int64_t packed_m, int64_t gelu) {
  return Run<T>(x, w, nullptr, y, n, threads, packed, packed_m, gelu);
}

// x w + bias, then the exact GELU, rounded to bf16: an MLP's first layer in one call.
ffi::Error BiasGelu(ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> bias,
                    ffi::ResultBuffer<ffi::BF16> y, int64_t n, int64_t threads, int64_t packed,
                    int64_t packed_m) {
  return Run<ffi::DataType::BF16>(x, w, bias.typed_data(), y, n, threads, packed, packed_m, 1);
}

}  // namespace

extern "C" int64_t vit22b_packed_bytes(int64_t m, int64_t k, int64_t n) {
  return static_cast<int64_t>(describe(m, k, n, true, dt::f32, false).weights_desc().get_size());
}

#define VIT22B_MATMUL_BINDING(T)                                                         \
  ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<T>>() \
      .Attr<int64_t>("n").Attr<int64_t>("threads").Attr<int64_t>("packed")                  \
      .Attr<int64_t>("packed_m").Attr<int64_t>("gelu")
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulF32, Matmul<ffi::DataType::F32>,
                              VIT22B_MATMUL_BINDING(ffi::DataType::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulBf16, Matmul<ffi::DataType::BF16>,
                              VIT22B_MATMUL_BINDING(ffi::DataType::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulBiasGeluBf16, BiasGelu,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("n").Attr<int64_t>("threads")
                                  .Attr<int64_t>("packed").Attr<int64_t>("packed_m"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PackWeights, Pack,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::U8>>().Attr<int64_t>("m"));
