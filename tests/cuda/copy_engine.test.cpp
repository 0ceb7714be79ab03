// SPDX-License-Identifier: Apache-2.0
// CopyEngine conformance for cuda_copy_engine: device memory on the device side, pinned memory on
// the host side, data put and read back through cudaMemcpy. Tier 1: compiled by the host compiler.
#include <chunkstar/cuda/cuda_copy_engine.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/device_space.hpp>
#include <chunkstar/cuda/pinned_host_space.hpp>
#include <chunkstar/cuda/stream.hpp>

#include <support/memory_conformance.hpp>

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <vector>

using namespace chunkstar;

namespace copy_engine_test {
using chunkstar::test::copy_side;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

struct cuda_engine_fixture {
  using engine_type = cuda::cuda_copy_engine;
  cuda::pinned_host_space host;
  cuda::device_space device{cuda::device_space_options{.device = 0, .capacity = 512 * mib}};
  cuda::cuda_copy_engine e{0};

  cuda::cuda_copy_engine& engine() { return e; }
  void* alloc(copy_side s, std::size_t n) {
    return s == copy_side::host ? host.allocate(n, 64) : device.allocate(n, 256);
  }
  void free(copy_side s, void* p, std::size_t n) {
    if (s == copy_side::host) host.deallocate(p, n, 64);
    else device.deallocate(p, n, 256);
  }
  void put(copy_side, void* block, const void* src, std::size_t n) {
    CHUNKSTAR_CUDA_CHECK(cudaMemcpy(block, src, n, cudaMemcpyDefault));
  }
  void get(copy_side, void* dst, const void* block, std::size_t n) {
    CHUNKSTAR_CUDA_CHECK(cudaMemcpy(dst, block, n, cudaMemcpyDefault));
  }
};

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(copy_engine_conformance, cuda_engine_fixture);

static_assert(CopyEngine<cuda::cuda_copy_engine>);
static_assert(CopyHandle<cuda::cuda_copy_handle>);

TEST_CASE("cuda_copy_engine: pageable host memory copies (synchronously) too; events order other streams") {
  cuda::cuda_copy_engine e;
  cuda::device_space d(cuda::device_space_options{.capacity = 64 * mib});
  const std::size_t n = 3 * mib + 7;
  const auto src = chunkstar::test::pattern(n, 42);
  std::vector<unsigned char> back(n);
  void* a = d.allocate(n);
  void* b = d.allocate(n);
  e.copy(a, src.data(), n, copy_direction::to_device);
  // A device-to-device copy on another stream, ordered after the upload by the handle's event.
  cuda::stream other(0);
  auto h = e.copy_async(b, a, n, copy_direction::host_to_host);
  CHUNKSTAR_CUDA_CHECK(cudaStreamWaitEvent(other.get(), h.event(), 0));
  CHUNKSTAR_CUDA_CHECK(cudaMemcpyAsync(back.data(), b, n, cudaMemcpyDefault, other.get()));
  other.synchronize();
  CHECK(back == src);
  CHECK(e.stats()[copy_direction::to_device].bytes == n);
  CHECK(e.stats()[copy_direction::host_to_host].copies == 1);
  CHECK(e.stats()[copy_direction::to_device].busy_s > 0);
  d.deallocate(a, n);
  d.deallocate(b, n);
}

}  // namespace copy_engine_test
