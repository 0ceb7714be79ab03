// SPDX-License-Identifier: Apache-2.0
// bench_gpu_cuda: what one GPU reaches, each measurement beside its limit, in one run.
//
//   hbm_copy      a grid-stride float4 copy of --size-mib MiB into a second buffer. Bytes = read +
//                 write (2 x size). Limit: the theoretical peak from the memory clock and bus width
//                 the driver reports (2 transfers per clock), when it reports both.
//   adam_G_P      chunkstar::cuda::adam_step_device on N = size / 4 parameters: fp32 master, m and
//                 v, a gradient of dtype G, and a parameter copy of dtype P written by the step
//                 ("none": the master is the parameter). Bytes per parameter = what the step must
//                 move: master, m, v read and written (24) + the gradient read (4 for f32, 2 for
//                 f16/bf16) + the parameter copy written (0 for none, 2 for f16/bf16). Limit:
//                 hbm_copy as measured in this run (a pure stream; Adam's arithmetic is not free).
//                 Before timing, each dtype pair is checked bit for bit against adam_step_host.
//   pinned_h2d/_d2h/_bidir  one --chunk-mib block per cudaMemcpyAsync between cudaMallocHost and
//                 cudaMalloc memory, each direction alone, then both at once on two streams (bytes =
//                 both blocks). No limit: the CUDA runtime does not report the link's peak.
//   engine_h2d/_d2h/_bidir  chunkstar::cuda::cuda_copy_engine moving chunks between
//                 cuda::pinned_host_space and cuda::device_space blocks as a runtime does: 16 chunks
//                 per repetition per direction, at most 4 in flight (the host waits for the oldest
//                 handle before queueing the fifth), timed on the host from the first copy_async to
//                 the last wait. Limit: the matching pinned_* result. The engine's copy_stats must
//                 count exactly the bytes and copies queued (else exit 1): stats_bytes is what they
//                 counted over the warm-up and every repetition, (reps + 1) x bytes; busy_gbs is that
//                 over the GPU-timed busy seconds they report (the longer direction's when both
//                 run): the link's rate without the host's gaps between copies.
//
// All timings are the best of --reps after one warm-up. GB/s = 1e9 bytes per second.
// Exit codes: 0 measured, 77 no usable GPU, 1 a CUDA error or a failed check, 2 bad options.
#include <chunkstar/cuda/adam.cuh>
#include <chunkstar/cuda/cuda_copy_engine.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/device_space.hpp>
#include <chunkstar/cuda/pinned_host_space.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Inside namespace chunkstar rather than `using namespace chunkstar`: with the using-directive,
// `cuda` is ambiguous (chunkstar::cuda vs CCCL's ::cuda) in the stub code nvcc generates.
namespace chunkstar::bench_gpu {

constexpr const char* prog = "bench_gpu_cuda";
constexpr std::size_t chunks_per_rep = 16;  // per direction, in each engine repetition
constexpr std::size_t in_flight = 4;        // handles outstanding per direction before the host waits

struct options {
  long long size_mib = 1024;
  long long chunk_mib = 64;
  int reps = 10;
  std::string json, plot;
};

// Every member has a default initialiser: nvcc hands the host compiler designated initialisers
// rewritten as positional ones, and -Wmissing-field-initializers would flag each omitted member.
struct record {
  std::string name = {};
  double bytes = 0, seconds = 0;
  std::optional<double> limit_gbs = {};
  std::string limit_name = {};                    // what the limit is, for the table and the JSON
  std::optional<double> busy_gbs = {};            // engine records: bytes / copy_stats busy seconds
  std::optional<std::uint64_t> stats_bytes = {};  // engine records: copy_stats bytes, warm-up and reps
  [[nodiscard]] double gbs() const { return bytes / seconds / 1e9; }
  [[nodiscard]] std::optional<double> ratio() const {
    if (!limit_gbs || *limit_gbs <= 0) return std::nullopt;
    return gbs() / *limit_gbs;
  }
};

/** A failed check that is not a CUDA error (a wrong result, a miscount): exit 1 like one. */
struct check_failed : error {
  using error::error;
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ---------------------------------------------------------------------------------------------
// Owned memory for (a)-(c): plain cudaMalloc / cudaMallocHost, as a user without chunkstar would.

struct device_buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit device_buffer(std::size_t n) : bytes(n) { CHUNKSTAR_CUDA_CHECK(cudaMalloc(&p, n)); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(p); }
  template <class T>
  [[nodiscard]] T* as() const {
    return static_cast<T*>(p);
  }
};

struct pinned_buffer {
  void* p = nullptr;
  explicit pinned_buffer(std::size_t n) { CHUNKSTAR_CUDA_CHECK(cudaMallocHost(&p, n)); }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { (void)cudaFreeHost(p); }
};

/** A block of one of chunkstar's spaces at the space's native alignment, handed back on destruction. */
template <class Space>
struct space_block {
  Space* space;
  std::size_t bytes;
  void* p;
  space_block(Space& s, std::size_t n) : space(&s), bytes(n), p(s.allocate(n, Space::native_alignment)) {}
  space_block(const space_block&) = delete;
  space_block& operator=(const space_block&) = delete;
  space_block(space_block&& o) noexcept : space(o.space), bytes(o.bytes), p(std::exchange(o.p, nullptr)) {}
  space_block& operator=(space_block&&) = delete;
  ~space_block() {
    if (p) space->deallocate(p, bytes, Space::native_alignment);
  }
};

struct timer_events {
  cuda::event start, end;
  /** Seconds between the two recorded events (after waiting for the second). */
  double seconds() const {
    end.synchronize();
    float ms = 0;
    CHUNKSTAR_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), end.get()));
    return static_cast<double>(ms) * 1e-3;
  }
};

/** Best of @p reps of @p enqueue (work queued on @p s), after one untimed warm-up. */
template <class F>
double best_gpu_seconds(int reps, cudaStream_t s, F&& enqueue) {
  timer_events t;
  enqueue();
  CHUNKSTAR_CUDA_CHECK(cudaStreamSynchronize(s));
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    t.start.record(s);
    enqueue();
    t.end.record(s);
    best = std::min(best, t.seconds());
  }
  return best;
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) cuda::detail::throw_cuda_failure(e, what, __FILE__, __LINE__);
}

unsigned grid_for(const void* kernel, int block, int sms) {
  int per_sm = 0;
  CHUNKSTAR_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, 0));
  return static_cast<unsigned>(std::max(1, per_sm) * sms);
}

// ---------------------------------------------------------------------------------------------
// Kernels

__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst, std::size_t n4) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += stride)
    dst[i] = src[i];
}

/** src[i] = the bits of i (mod 2^32), so a copy can be checked at any index. */
__global__ void iota_kernel(unsigned* p, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = static_cast<unsigned>(i);
}

/** p[i] = scale * ((i % 1000) / 1000 - 0.5) + offset, rounded to T: finite, varied, cheap. */
template <class T>
__global__ void fill_kernel(T* p, std::size_t n, float scale, float offset) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = from_float<T>(scale * (static_cast<float>(i % 1000) * 1e-3f - 0.5f) + offset);
}

template <class T>
void fill(T* p, std::size_t n, float scale, float offset, cudaStream_t s) {
  fill_kernel<T><<<1024, 256, 0, s>>>(p, n, scale, offset);
  check_launch("fill_kernel<<<...>>>");
}

// ---------------------------------------------------------------------------------------------
// (a) HBM copy

record bench_hbm(std::size_t bytes, int reps, int sms, std::optional<double> peak_gbs, cudaStream_t s) {
  device_buffer src(bytes), dst(bytes);
  const std::size_t n4 = bytes / sizeof(float4);
  iota_kernel<<<1024, 256, 0, s>>>(src.as<unsigned>(), bytes / sizeof(unsigned));
  check_launch("iota_kernel<<<...>>>");
  constexpr int block = 256;
  const unsigned grid = grid_for(reinterpret_cast<const void*>(&copy_kernel), block, sms);
  const double t = best_gpu_seconds(reps, s, [&] {
    copy_kernel<<<grid, block, 0, s>>>(src.as<const float4>(), dst.as<float4>(), n4);
    check_launch("copy_kernel<<<...>>>");
  });
  // The copy is right at the ends and at a sample of indices in between.
  const std::size_t words = bytes / sizeof(unsigned);
  std::mt19937_64 rng(7);
  std::vector<std::size_t> at = {0, words - 1};
  for (int i = 0; i < 64; ++i) at.push_back(rng() % words);
  for (const std::size_t i : at) {
    unsigned got = 0;
    CHUNKSTAR_CUDA_CHECK(cudaMemcpy(&got, dst.as<unsigned>() + i, sizeof got, cudaMemcpyDeviceToHost));
    if (got != static_cast<unsigned>(i))
      throw check_failed("hbm_copy: dst[" + std::to_string(i) + "] = " + std::to_string(got) + ", expected " +
                         std::to_string(static_cast<unsigned>(i)) + ": the copy kernel is wrong");
  }
  return {.name = "hbm_copy",
          .bytes = 2.0 * static_cast<double>(bytes),
          .seconds = t,
          .limit_gbs = peak_gbs,
          .limit_name = peak_gbs ? "HBM peak (clock x bus)" : "unknown"};
}

// ---------------------------------------------------------------------------------------------
// (b) device Adam

struct adam_config {
  dtype grad;
  std::optional<dtype> param;  // nullopt: the master is the parameter
};

std::string config_name(const adam_config& c) {
  return "adam_" + std::string(dtype_name(c.grad)) + "_" + (c.param ? std::string(dtype_name(*c.param)) : "none");
}

std::size_t dtype_bytes(dtype t) { return t == dtype::f32 ? 4 : 2; }

const adam_hyper bench_hyper{.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};

template <class T>
std::vector<std::byte> random_bytes(std::size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<T> v(n);
  for (auto& x : v) x = from_float<T>(d(rng));
  std::vector<std::byte> out(n * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<std::byte> random_of(dtype t, std::size_t n, std::mt19937& rng, float sd) {
  switch (t) {
    case dtype::f32: return random_bytes<float>(n, rng, sd);
    case dtype::f16: return random_bytes<float16>(n, rng, sd);
    case dtype::bf16: return random_bytes<bfloat16>(n, rng, sd);
  }
  throw check_failed("unknown dtype");
}

/** Three steps of adam_step_device and of adam_step_host from the same state: bit for bit equal
 *  (the device kernel runs the host's sequence of correctly rounded operations). 100003 elements:
 *  the vectorised body and a tail. */
void verify_adam(const adam_config& c, cudaStream_t s) {
  constexpr std::size_t n = 100003;
  std::mt19937 rng(11);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  std::normal_distribution<float> d(0.0f, 0.3f);
  for (auto& x : master) x = d(rng);
  const std::size_t pbytes = c.param ? n * dtype_bytes(*c.param) : 0;
  std::vector<std::byte> param(pbytes);
  device_buffer dmaster(n * 4), dm(n * 4), dv(n * 4), dg(n * dtype_bytes(c.grad)), dp(std::max<std::size_t>(pbytes, 1));
  CHUNKSTAR_CUDA_CHECK(cudaMemcpy(dmaster.p, master.data(), n * 4, cudaMemcpyHostToDevice));
  CHUNKSTAR_CUDA_CHECK(cudaMemcpy(dm.p, m.data(), n * 4, cudaMemcpyHostToDevice));
  CHUNKSTAR_CUDA_CHECK(cudaMemcpy(dv.p, v.data(), n * 4, cudaMemcpyHostToDevice));
  for (std::int64_t step = 1; step <= 3; ++step) {
    auto grad = random_of(c.grad, n, rng, 0.1f);
    CHUNKSTAR_CUDA_CHECK(cudaMemcpy(dg.p, grad.data(), grad.size(), cudaMemcpyHostToDevice));
    const adam_step_args a{.step = step, .grad_scale = 0.5f};
    const dtype pt = c.param.value_or(dtype::f32);
    adam_step_host({.master = master.data(),
                    .m = m.data(),
                    .v = v.data(),
                    .count = n,
                    .grad = grad.data(),
                    .grad_type = c.grad,
                    .param = c.param ? param.data() : nullptr,
                    .param_type = pt},
                   bench_hyper, a);
    cuda::adam_step_device({.master = dmaster.as<float>(),
                            .m = dm.as<float>(),
                            .v = dv.as<float>(),
                            .count = n,
                            .grad = dg.p,
                            .grad_type = c.grad,
                            .param = c.param ? dp.p : nullptr,
                            .param_type = pt},
                           bench_hyper, a, s);
    CHUNKSTAR_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  const auto same = [&](const device_buffer& dev, const void* host, std::size_t bytes) {
    std::vector<std::byte> back(bytes);
    CHUNKSTAR_CUDA_CHECK(cudaMemcpy(back.data(), dev.p, bytes, cudaMemcpyDeviceToHost));
    return std::memcmp(back.data(), host, bytes) == 0;
  };
  if (!same(dmaster, master.data(), n * 4) || !same(dm, m.data(), n * 4) || !same(dv, v.data(), n * 4) ||
      (c.param && !same(dp, param.data(), pbytes)))
    throw check_failed(config_name(c) + ": adam_step_device differs from adam_step_host; not timing it");
}

std::vector<record> bench_adam(std::size_t size_bytes, int reps, double hbm_gbs, cudaStream_t s) {
  const std::vector<adam_config> configs = {
      {dtype::f32, std::nullopt}, {dtype::f32, dtype::bf16}, {dtype::bf16, dtype::bf16}, {dtype::f16, dtype::f16}};
  for (const auto& c : configs) verify_adam(c, s);

  const std::size_t n = size_bytes / 4;
  const std::size_t need = 3 * 4 * n + 4 * n + 2 * n;  // master, m, v, the widest gradient, a 16-bit copy
  std::size_t free_b = 0, total_b = 0;
  CHUNKSTAR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (need + (std::size_t{256} << 20) > free_b)
    throw check_failed("adam: " + std::to_string(n) + " parameters need " + std::to_string(need >> 20) + " MiB, " +
                       std::to_string(free_b >> 20) + " MiB are free; lower --size-mib");
  device_buffer master(4 * n), m(4 * n), v(4 * n), grad(4 * n), param(2 * n);
  std::vector<record> out;
  std::int64_t step = 0;
  for (const auto& c : configs) {
    fill(master.as<float>(), n, 0.2f, 0.0f, s);
    CHUNKSTAR_CUDA_CHECK(cudaMemsetAsync(m.p, 0, 4 * n, s));
    CHUNKSTAR_CUDA_CHECK(cudaMemsetAsync(v.p, 0, 4 * n, s));
    switch (c.grad) {
      case dtype::f32: fill(grad.as<float>(), n, 2e-3f, 1e-4f, s); break;
      case dtype::f16: fill(grad.as<float16>(), n, 2e-3f, 1e-4f, s); break;
      case dtype::bf16: fill(grad.as<bfloat16>(), n, 2e-3f, 1e-4f, s); break;
    }
    const adam_chunk ch{.master = master.as<float>(),
                        .m = m.as<float>(),
                        .v = v.as<float>(),
                        .count = n,
                        .grad = grad.p,
                        .grad_type = c.grad,
                        .param = c.param ? param.p : nullptr,
                        .param_type = c.param.value_or(dtype::f32)};
    const double t = best_gpu_seconds(reps, s, [&] { cuda::adam_step_device(ch, bench_hyper, {.step = ++step}, s); });
    const double per_param =
        24.0 + static_cast<double>(dtype_bytes(c.grad)) + (c.param ? static_cast<double>(dtype_bytes(*c.param)) : 0.0);
    out.push_back({.name = config_name(c),
                   .bytes = per_param * static_cast<double>(n),
                   .seconds = t,
                   .limit_gbs = hbm_gbs,
                   .limit_name = "hbm_copy"});
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// (c) pinned cudaMemcpyAsync

std::vector<record> bench_pinned(std::size_t chunk, int reps) {
  pinned_buffer h_src(chunk), h_dst(chunk);
  device_buffer d_dst(chunk), d_src(chunk);
  std::memset(h_src.p, 1, chunk);  // touched, so no first-use cost hides in the first copy
  std::memset(h_dst.p, 0, chunk);
  const cuda::stream s1(0), s2(0);
  const auto h2d = [&](cudaStream_t s) {
    CHUNKSTAR_CUDA_CHECK(cudaMemcpyAsync(d_dst.p, h_src.p, chunk, cudaMemcpyHostToDevice, s));
  };
  const auto d2h = [&](cudaStream_t s) {
    CHUNKSTAR_CUDA_CHECK(cudaMemcpyAsync(h_dst.p, d_src.p, chunk, cudaMemcpyDeviceToHost, s));
  };
  const double t_h2d = best_gpu_seconds(reps, s1.get(), [&] { h2d(s1.get()); });
  const double t_d2h = best_gpu_seconds(reps, s1.get(), [&] { d2h(s1.get()); });
  // Both at once: s2 starts with s1's start event; the time runs to the later of the two ends.
  cuda::event start, end1, end2;
  double t_bi = 1e30;
  for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up
    start.record(s1.get());
    CHUNKSTAR_CUDA_CHECK(cudaStreamWaitEvent(s2.get(), start.get(), 0));
    h2d(s1.get());
    d2h(s2.get());
    end1.record(s1.get());
    end2.record(s2.get());
    end1.synchronize();
    end2.synchronize();
    float ms1 = 0, ms2 = 0;
    CHUNKSTAR_CUDA_CHECK(cudaEventElapsedTime(&ms1, start.get(), end1.get()));
    CHUNKSTAR_CUDA_CHECK(cudaEventElapsedTime(&ms2, start.get(), end2.get()));
    if (r > 0) t_bi = std::min(t_bi, static_cast<double>(std::max(ms1, ms2)) * 1e-3);
  }
  const double b = static_cast<double>(chunk);
  return {{.name = "pinned_h2d", .bytes = b, .seconds = t_h2d, .limit_name = "none"},
          {.name = "pinned_d2h", .bytes = b, .seconds = t_d2h, .limit_name = "none"},
          {.name = "pinned_bidir", .bytes = 2 * b, .seconds = t_bi, .limit_name = "none"}};
}

// ---------------------------------------------------------------------------------------------
// (d) chunk moves through cuda_copy_engine

std::vector<record> bench_engine(std::size_t chunk, int reps, const std::vector<record>& pinned) {
  cuda::device_space dev;
  cuda::pinned_host_space host;
  // A ring of in_flight chunk slots per direction on each side: loads read pinned, write device;
  // offloads read device, write pinned.
  std::vector<space_block<cuda::pinned_host_space>> load_src, off_dst;
  std::vector<space_block<cuda::device_space>> load_dst, off_src;
  for (std::size_t i = 0; i < in_flight; ++i) {
    load_src.emplace_back(host, chunk);
    off_dst.emplace_back(host, chunk);
    load_dst.emplace_back(dev, chunk);
    off_src.emplace_back(dev, chunk);
    std::memset(load_src.back().p, 1, chunk);
    std::memset(off_dst.back().p, 0, chunk);
  }
  // Declared after the blocks, so it goes first: its destructor waits for every queued copy
  // before the memory they touch is handed back (also when a check throws mid-queue).
  cuda::cuda_copy_engine engine(0);

  struct mode {
    const char* name;
    bool load, offload;
    const char* limit;
  };
  const std::array<mode, 3> modes{{{"engine_h2d", true, false, "pinned_h2d"},
                                   {"engine_d2h", false, true, "pinned_d2h"},
                                   {"engine_bidir", true, true, "pinned_bidir"}}};
  std::vector<record> out;
  for (const auto& md : modes) {
    const copy_stats before = engine.stats();
    double best = 1e30;
    for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up
      std::deque<cuda::cuda_copy_handle> loads, offloads;
      const double t0 = now();
      for (std::size_t i = 0; i < chunks_per_rep; ++i) {
        const std::size_t slot = i % in_flight;
        if (md.load) {
          if (loads.size() == in_flight) {
            loads.front().wait();
            loads.pop_front();
          }
          loads.push_back(engine.copy_async(load_dst[slot].p, load_src[slot].p, chunk, copy_direction::to_device));
        }
        if (md.offload) {
          if (offloads.size() == in_flight) {
            offloads.front().wait();
            offloads.pop_front();
          }
          offloads.push_back(engine.copy_async(off_dst[slot].p, off_src[slot].p, chunk, copy_direction::to_host));
        }
      }
      for (const auto& h : loads) h.wait();
      for (const auto& h : offloads) h.wait();
      const double t = now() - t0;
      if (r > 0) best = std::min(best, t);
    }
    const copy_stats after = engine.stats();
    // Cross-check: the engine counted every byte and copy queued, in the right direction only.
    const std::uint64_t per_dir = static_cast<std::uint64_t>(reps + 1) * chunks_per_rep;
    double busy = 0;
    std::uint64_t counted = 0;
    for (const auto d : {copy_direction::to_device, copy_direction::to_host}) {
      const bool on = d == copy_direction::to_device ? md.load : md.offload;
      const std::uint64_t bytes = after[d].bytes - before[d].bytes, copies = after[d].copies - before[d].copies;
      if (bytes != (on ? per_dir * chunk : 0) || copies != (on ? per_dir : 0))
        throw check_failed(std::string(md.name) + ": copy_stats counted " + std::to_string(bytes) + " bytes in " +
                           std::to_string(copies) + " copies " + std::string(to_string(d)) + ", expected " +
                           std::to_string(on ? per_dir * chunk : 0) + " in " + std::to_string(on ? per_dir : 0));
      counted += bytes;
      busy = std::max(busy, after[d].busy_s - before[d].busy_s);  // directions overlap: the longer one
    }
    record rec{.name = md.name,
               .bytes = static_cast<double>(chunks_per_rep) * static_cast<double>(chunk) *
                        ((md.load ? 1 : 0) + (md.offload ? 1 : 0)),
               .seconds = best,
               .limit_name = md.limit,
               .stats_bytes = counted};
    if (busy > 0) rec.busy_gbs = static_cast<double>(counted) / busy / 1e9;
    for (const auto& p : pinned)
      if (p.name == md.limit) rec.limit_gbs = p.gbs();
    out.push_back(rec);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Output

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\', o += ch;
    else if (static_cast<unsigned char>(ch) < 0x20) o += ' ';
    else o += ch;
  }
  return o + "\"";
}

std::string json_number(std::optional<double> v) {
  if (!v) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", *v);
  return buf;
}

struct device_info {
  std::string name;
  int sm_count = 0, cc_major = 0, cc_minor = 0, driver = 0, runtime = 0;
  std::size_t memory = 0;
  std::optional<double> hbm_peak_gbs;
};

std::string version(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

void write_json(const std::string& path, const device_info& d, const options& o, const std::vector<record>& recs) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw check_failed("cannot write " + path + ": " + std::strerror(errno));
  std::fprintf(f,
               "[\n  {\"name\": \"header\", \"device\": %s, \"compute_capability\": \"%d.%d\", \"sm_count\": %d, "
               "\"memory_bytes\": %zu, \"driver_version\": \"%s\", \"runtime_version\": \"%s\", "
               "\"hbm_peak_gbs\": %s, \"size_mib\": %lld, \"chunk_mib\": %lld, \"reps\": %d, "
               "\"chunks_per_rep\": %zu, \"in_flight\": %zu}",
               json_string(d.name).c_str(), d.cc_major, d.cc_minor, d.sm_count, d.memory, version(d.driver).c_str(),
               version(d.runtime).c_str(), json_number(d.hbm_peak_gbs).c_str(), o.size_mib, o.chunk_mib, o.reps,
               chunks_per_rep, in_flight);
  for (const auto& r : recs) {
    std::fprintf(f,
                 ",\n  {\"name\": %s, \"bytes\": %.0f, \"seconds\": %.6g, \"gbs\": %.6g, \"limit_gbs\": %s, "
                 "\"ratio\": %s, \"limit_name\": %s",
                 json_string(r.name).c_str(), r.bytes, r.seconds, r.gbs(), json_number(r.limit_gbs).c_str(),
                 json_number(r.ratio()).c_str(), json_string(r.limit_name).c_str());
    if (r.stats_bytes) std::fprintf(f, ", \"stats_bytes\": %llu", static_cast<unsigned long long>(*r.stats_bytes));
    if (r.busy_gbs) std::fprintf(f, ", \"busy_gbs\": %s", json_number(r.busy_gbs).c_str());
    std::fprintf(f, "}");
  }
  std::fprintf(f, "\n]\n");
  if (std::fclose(f) != 0) throw check_failed("cannot write " + path);
}

void write_plot(const std::string& png, const std::vector<record>& recs) {
  const std::string dat = png + ".dat";
  FILE* f = std::fopen(dat.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "%s: cannot write %s; no plot\n", prog, dat.c_str());
    return;
  }
  int k = 0;
  for (const auto& r : recs) {  // NaN: no limit, gnuplot leaves the bar out
    const std::string limit = r.limit_gbs ? std::to_string(*r.limit_gbs) : "NaN";
    std::fprintf(f, "%d \"%s\" %.3f %s\n", k++, r.name.c_str(), r.gbs(), limit.c_str());
  }
  std::fclose(f);
  // Log scale: HBM rates are ~100x the host link's.
  const std::string cmd = "gnuplot -e \"set terminal png noenhanced size 1200,500; set output '" + png +
                          "'; set style data histograms; set style fill solid; set logscale y; set ylabel 'GB/s'; "
                          "set xtics rotate by -45; plot '" +
                          dat + "' using 3:xtic(2) title 'measured', '' using 4 title 'limit'\" 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "%s: gnuplot failed; the table and JSON stand\n", prog);
}

void print_table(const std::vector<record>& recs) {
  std::printf("%-16s %10s %11s %10s %10s %7s  %s\n", "name", "MiB", "seconds", "GB/s", "limit GB/s", "ratio", "limit");
  for (const auto& r : recs) {
    char limit[32] = "-", ratio[32] = "-";
    if (r.limit_gbs) std::snprintf(limit, sizeof limit, "%.1f", *r.limit_gbs);
    if (r.ratio()) std::snprintf(ratio, sizeof ratio, "%.1f%%", 100.0 * *r.ratio());
    std::printf("%-16s %10.1f %11.6f %10.1f %10s %7s  %s", r.name.c_str(), r.bytes / double(1 << 20), r.seconds,
                r.gbs(), limit, ratio, r.limit_name.c_str());
    if (r.busy_gbs)
      std::printf(" (copy_stats: %.1f MiB, busy %.1f GB/s)", double(*r.stats_bytes) / double(1 << 20), *r.busy_gbs);
    std::printf("\n");
  }
}

// ---------------------------------------------------------------------------------------------
// Command line

void usage(FILE* f) {
  std::fprintf(f,
               "usage: %s [--size-mib N] [--chunk-mib N] [--reps N] [--json FILE] [--plot FILE.png] [--help]\n"
               "  --size-mib N   HBM copy buffer and each fp32 Adam array, MiB (default 1024)\n"
               "  --chunk-mib N  block of the pinned and engine copies, MiB (default 64)\n"
               "  --reps N       timed repetitions, best kept, after one warm-up (default 10)\n"
               "  --json FILE    an array: a header record (device, SMs, versions), then one record per\n"
               "                 measurement {name, bytes, seconds, gbs, limit_gbs, ratio, limit_name}\n"
               "  --plot FILE    a bar chart of measured and limit GB/s (needs gnuplot)\n"
               "Exit: 0 measured, 77 no usable GPU, 1 CUDA error or failed check, 2 bad options.\n",
               prog);
}

/** Parses options; exits 0 for --help and 2 for anything wrong. */
options parse(int argc, char** argv) {
  options o;
  const auto fail = [](const std::string& why) {
    std::fprintf(stderr, "%s: %s\n", prog, why.c_str());
    usage(stderr);
    std::exit(2);
  };
  const auto integer = [&](const std::string& opt, const char* text, long long lo, long long hi) {
    long long v = 0;
    try {
      std::size_t used = 0;
      v = std::stoll(text, &used);
      if (used != std::strlen(text)) throw std::invalid_argument(text);
    } catch (const std::logic_error&) {
      fail(opt + ": '" + text + "' is not an integer");
    }
    if (v < lo || v > hi)
      fail(opt + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(stdout);
      std::exit(0);
    }
    if (i + 1 >= argc)
      fail(a.rfind("--", 0) == 0 ? a + " needs a value, or is unknown" : "unexpected argument '" + a + "'");
    const char* val = argv[++i];
    if (a == "--size-mib") o.size_mib = integer(a, val, 1, 1 << 20);
    else if (a == "--chunk-mib") o.chunk_mib = integer(a, val, 1, 1 << 14);
    else if (a == "--reps") o.reps = static_cast<int>(integer(a, val, 1, 10000));
    else if (a == "--json") o.json = val;
    else if (a == "--plot") o.plot = val;
    else fail("unknown option '" + a + "'");
  }
  return o;
}

int run(const options& o) {
  device_info d;
  CHUNKSTAR_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CHUNKSTAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  d.name = prop.name;
  d.sm_count = prop.multiProcessorCount;
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.memory = prop.totalGlobalMem;
  CHUNKSTAR_CUDA_CHECK(cudaDriverGetVersion(&d.driver));
  CHUNKSTAR_CUDA_CHECK(cudaRuntimeGetVersion(&d.runtime));
  int mem_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0) != cudaSuccess) mem_khz = 0;
  if (cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0) != cudaSuccess) bus_bits = 0;
  (void)cudaGetLastError();
  if (mem_khz > 0 && bus_bits > 0) d.hbm_peak_gbs = 2.0 * mem_khz * 1e3 * (bus_bits / 8.0) / 1e9;

  const std::size_t size = static_cast<std::size_t>(o.size_mib) << 20;
  const std::size_t chunk = static_cast<std::size_t>(o.chunk_mib) << 20;
  std::printf("%s: %s (sm_%d%d, %d SMs, %.1f GiB), driver %s, runtime %s\n", prog, d.name.c_str(), d.cc_major,
              d.cc_minor, d.sm_count, double(d.memory) / double(1u << 30), version(d.driver).c_str(),
              version(d.runtime).c_str());
  std::printf("buffer %lld MiB, chunk %lld MiB, best of %d reps; engine: %zu chunks per rep, %zu in flight\n",
              o.size_mib, o.chunk_mib, o.reps, chunks_per_rep, in_flight);
  std::fflush(stdout);

  const double t0 = now();
  const cuda::stream s(0);
  std::vector<record> recs;
  recs.push_back(bench_hbm(size, o.reps, d.sm_count, d.hbm_peak_gbs, s.get()));
  const double hbm = recs.back().gbs();
  for (auto& r : bench_adam(size, o.reps, hbm, s.get())) recs.push_back(r);
  const auto pinned = bench_pinned(chunk, o.reps);
  recs.insert(recs.end(), pinned.begin(), pinned.end());
  for (auto& r : bench_engine(chunk, o.reps, pinned)) recs.push_back(r);
  CHUNKSTAR_CUDA_CHECK(cudaDeviceSynchronize());

  print_table(recs);
  std::printf("%s: %.1f s\n", prog, now() - t0);
  if (!o.json.empty()) write_json(o.json, d, o, recs);
  if (!o.plot.empty()) write_plot(o.plot, recs);
  return 0;
}

}  // namespace chunkstar::bench_gpu

int main(int argc, char** argv) {
  namespace bg = chunkstar::bench_gpu;
  const bg::options o = bg::parse(argc, argv);
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("%s: SKIPPED: no usable CUDA device (cudaGetDeviceCount: %s, %d devices)\n", bg::prog,
                status == cudaSuccess ? "ok" : cudaGetErrorString(status), devices);
    return 77;
  }
  // The first runtime call that creates a context: a device the driver will not hand out
  // (prohibited or exclusive-and-busy compute mode, a driver too old) is no usable GPU either.
  const cudaError_t ctx = cudaFree(nullptr);
  if (ctx == cudaErrorDevicesUnavailable || ctx == cudaErrorInsufficientDriver || ctx == cudaErrorNoDevice ||
      ctx == cudaErrorSystemDriverMismatch) {
    std::printf("%s: SKIPPED: no usable CUDA device (creating a context: %s)\n", bg::prog, cudaGetErrorString(ctx));
    return 77;
  }
  try {
    return bg::run(o);
  } catch (const chunkstar::cuda::cuda_error& e) {
    std::fprintf(stderr, "%s: CUDA error: %s\n", bg::prog, e.what());
    if (e.code() == cudaErrorNoKernelImageForDevice || e.code() == cudaErrorUnsupportedPtxVersion)
      std::fprintf(stderr,
                   "%s: this binary has no code for this GPU: reconfigure with "
                   "-DCMAKE_CUDA_ARCHITECTURES=<compute capability, e.g. 90>\n",
                   bg::prog);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", bg::prog, e.what());
    return 1;
  }
}
