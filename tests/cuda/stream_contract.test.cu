// SPDX-License-Identifier: Apache-2.0
// The stream contract on the CUDA platform (docs style entry 18): a scope hands device memory to
// the user's own stream; `close(stream)` hands it back without synchronising, and every later use
// of that memory by the runtime — an eviction, an offload, a read — is ordered after the user's
// kernel on the device. The kernel here spins (for ~200 ms of GPU time) before it writes, so a
// runtime that moved or read the chunk after nothing would see the old values.
#include <chunkstar/cuda/cuda_platform.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace chunkstar {
namespace stream_contract_test {

/** Spins for @p spin_ns of GPU time (the %globaltimer register), then writes base + i. */
__global__ void spin_then_write(float* out, std::size_t n, unsigned long long spin_ns, float base) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < spin_ns);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = base + static_cast<float>(i);
}

constexpr unsigned long long spin_ns = 200'000'000;  // 200 ms: far longer than any copy here
constexpr std::size_t n = 1 << 16;                   // one chunk of fp32

using rt_t = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer,
                           single_process_communicator, cuda::cuda_platform>;

/** The user's own non-blocking stream (no implicit ordering with any other stream). */
struct user_stream {
  cudaStream_t s = nullptr;
  user_stream() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~user_stream() {
    (void)cudaStreamSynchronize(s);
    (void)cudaStreamDestroy(s);
  }
  user_stream(const user_stream&) = delete;
  user_stream& operator=(const user_stream&) = delete;
};

void launch(std::span<float> span, cudaStream_t s, float base) {
  spin_then_write<<<64, 256, 0, s>>>(span.data(), span.size(), spin_ns, base);
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

void check_values(const std::vector<float>& v, float base) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < v.size(); ++i) wrong += v[i] != base + static_cast<float>(i);
  CHECK_MESSAGE(wrong == 0, wrong << " of " << v.size() << " values are not the kernel's (first: " << v[0] << ")");
}

runtime_options options() {
  return {.optimizer_state = optimizer_state_lists::none(), .prefetch_depth = 0, .payload_alignment = 256};
}

}  // namespace stream_contract_test
using namespace stream_contract_test;

TEST_CASE("CUDA stream contract: an offload after close(stream) carries the user's kernel's writes") {
  cuda::device_space dev({.capacity = 64u << 20});
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  rt_t rt(dev, host, copier, options(), fixed_chunk_layout({.chunk_elems = n}), static_placement::all_device());
  const auto w = rt.register_param({"w", {static_cast<std::int64_t>(n)}, dtype::f32, tensor_role::weight},
                                   [](std::span<float> v) { std::fill(v.begin(), v.end(), -1.0f); });
  rt.finalize();
  user_stream user;
  {
    auto s = rt.forward("f", {w});
    launch(s.param<float>(w), user.s, 3.0f);
    s.close(user.s);                                      // hands the memory back; does not synchronise
    CHECK(cudaStreamQuery(user.s) == cudaErrorNotReady);  // the kernel is still running
  }
  rt.offload({chunk_kind::param, 0});  // the eviction's copy waits for the kernel on the device
  CHECK(rt.where({chunk_kind::param, 0}) == tier::host);
  std::vector<float> v(n);
  rt.read_tensor(w, chunk_kind::param, v);
  check_values(v, 3.0f);
  rt.end_iteration();
}

TEST_CASE(
    "CUDA stream contract: a budget eviction after close(stream) is ordered after the kernel, and the host does not "
    "wait") {
  cuda::device_space dev({.capacity = 64u << 20});
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  // Two params of one chunk each, param + grad lists: a quarter of the chunks may be on the device.
  rt_t rt(dev, host, copier, options(), fixed_chunk_layout({.chunk_elems = n}), static_placement::fraction(0.25));
  const auto a = rt.register_param({"a", {static_cast<std::int64_t>(n)}, dtype::f32, tensor_role::weight});
  const auto b = rt.register_param({"b", {static_cast<std::int64_t>(n)}, dtype::f32, tensor_role::weight});
  rt.finalize();
  user_stream user;
  {
    auto s = rt.forward("fa", {a});
    launch(s.param<float>(a), user.s, 5.0f);
    s.close(user.s);
  }
  { auto s = rt.forward("fb", {b}); }  // evicts a's chunk
  CHECK(rt.where({chunk_kind::param, 0}) == tier::host);
  CHECK(cudaStreamQuery(user.s) == cudaErrorNotReady);  // opening fb did not wait for the user's kernel
  std::vector<float> v(n);
  rt.read_tensor(a, chunk_kind::param, v);  // waits for the eviction, which waited for the kernel
  check_values(v, 5.0f);
  rt.end_iteration();
}

TEST_CASE("CUDA stream contract: reading a chunk still on the device after close(stream) sees the kernel's writes") {
  cuda::device_space dev({.capacity = 64u << 20});
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  rt_t rt(dev, host, copier, options(), fixed_chunk_layout({.chunk_elems = n}), static_placement::all_device());
  const auto w = rt.register_param({"w", {static_cast<std::int64_t>(n)}, dtype::f32, tensor_role::weight});
  rt.finalize();
  user_stream user;
  {
    auto s = rt.forward("f", {w});
    launch(s.param<float>(w), user.s, 9.0f);
    s.close(user.s);
  }
  REQUIRE(rt.where({chunk_kind::param, 0}) == tier::device);
  std::vector<float> v(n);
  rt.read_tensor(w, chunk_kind::param, v);
  check_values(v, 9.0f);
  rt.end_iteration();
}

TEST_CASE("CUDA stream contract: a device-side optimizer step sees the gradients the user's backward kernel wrote") {
  cuda::device_space dev({.capacity = 64u << 20});
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  rt_t rt(dev, host, copier, options(), fixed_chunk_layout({.chunk_elems = n}), static_placement::all_device());
  const auto w = rt.register_param({"w", {static_cast<std::int64_t>(n)}, dtype::f32, tensor_role::weight});
  rt.finalize();
  user_stream user;
  {
    auto s = rt.backward("b", {w});
    launch(s.grad<float>(w), user.s, 11.0f);
    s.close(user.s);
  }
  std::vector<float> seen(n, -1.0f);
  rt.step([&](const step_chunk& c) {
    REQUIRE(c.where == tier::device);
    // An update kernel would run here; what it would read is what this copy reads.
    REQUIRE(cudaMemcpy(seen.data(), c.grad, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  });
  check_values(seen, 11.0f);
}

}  // namespace chunkstar
