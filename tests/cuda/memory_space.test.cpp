// SPDX-License-Identifier: Apache-2.0
// MemorySpace conformance for the CUDA spaces (device memory checked through cudaMemcpy), their
// rows of the trait table, and CHUNKSTAR_CUDA_CHECK. Tier 1: compiled by the host compiler.
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/device_space.hpp>
#include <chunkstar/cuda/pinned_host_space.hpp>
#include <chunkstar/cuda/stream.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <support/memory_conformance.hpp>

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>

using namespace chunkstar;

namespace memory_space_test {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

struct via_cuda_memcpy {
  static void write(void* block, const void* host, std::size_t n) {
    if (n != 0) CHUNKSTAR_CUDA_CHECK(cudaMemcpy(block, host, n, cudaMemcpyDefault));
  }
  static void read(void* host, const void* block, std::size_t n) {
    if (n != 0) CHUNKSTAR_CUDA_CHECK(cudaMemcpy(host, block, n, cudaMemcpyDefault));
  }
};
struct device_capped : via_cuda_memcpy {
  using space_type = cuda::device_space;
  static std::unique_ptr<space_type> make() {
    return std::make_unique<space_type>(cuda::device_space_options{.device = 0, .capacity = 64 * mib});
  }
};
struct device_whole : via_cuda_memcpy {
  using space_type = cuda::device_space;
  static std::unique_ptr<space_type> make() { return std::make_unique<space_type>(); }
};
struct pinned_capped : via_cuda_memcpy {
  using space_type = cuda::pinned_host_space;
  static std::unique_ptr<space_type> make() {
    return std::make_unique<space_type>(cuda::pinned_host_options{.capacity = 64 * mib});
  }
};
struct pinned_uncapped : via_cuda_memcpy {
  using space_type = cuda::pinned_host_space;
  static std::unique_ptr<space_type> make() { return std::make_unique<space_type>(); }
};

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(memory_space_conformance, device_capped, device_whole, pinned_capped, pinned_uncapped);

// The CUDA rows of the trait table.
static_assert(can_access_v<cuda_exec, cuda::device_space>);
static_assert(!can_access_v<host_exec, cuda::device_space>);
static_assert(can_access_v<host_exec, cuda::pinned_host_space>);
static_assert(can_access_v<cuda_exec, cuda::pinned_host_space>);
static_assert(copy_traits<cuda::device_space, cuda::pinned_host_space>::possible);
static_assert(copy_traits<cuda::device_space, cuda::pinned_host_space>::async);
static_assert(copy_traits<cuda::pinned_host_space, cuda::device_space>::async);
static_assert(copy_traits<cuda::device_space, cuda::device_space>::async);
static_assert(copy_traits<host_space, cuda::device_space>::possible);
static_assert(!copy_traits<host_space, cuda::device_space>::async);
static_assert(copy_traits<cuda::device_space, host_space>::possible);
static_assert(!copy_traits<cuda::device_space, host_space>::async);
static_assert(copy_traits<host_space, cuda::pinned_host_space>::async);
static_assert(copy_traits<cuda::pinned_host_space, host_space>::async);
static_assert(MemorySpace<cuda::device_space>);
static_assert(MemorySpace<cuda::pinned_host_space>);

TEST_CASE("device_space: the driver's own out-of-memory becomes nullptr / out_of_memory_error") {
  cuda::device_space d;
  CHECK(d.name() == "cuda:0");
  std::size_t free = 0, total = 0;
  CHUNKSTAR_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  CHECK(d.capacity() == total);
  CHECK(d.usage().largest_free_block <= free);
  const std::size_t n = free + 64 * mib;  // within the accounting's capacity, beyond what the device has
  REQUIRE(n <= d.capacity());
  CHECK(d.try_allocate(n, 256) == nullptr);
  CHECK(d.used() == 0);
  CHECK_THROWS_AS((void)d.allocate(n, 256), out_of_memory_error);
  void* p = d.allocate(mib, 256);  // the failed requests left no sticky error behind
  CHECK(cudaGetLastError() == cudaSuccess);
  d.deallocate(p, mib, 256);
}

TEST_CASE("device_space: allocations restore the caller's current device") {
  int before = -1;
  CHUNKSTAR_CUDA_CHECK(cudaGetDevice(&before));
  cuda::device_space d(cuda::device_space_options{.device = 0, .capacity = 8 * mib, .name = "gpu"});
  void* p = d.allocate(mib, 4096);
  int after = -1;
  CHUNKSTAR_CUDA_CHECK(cudaGetDevice(&after));
  CHECK(after == before);
  cudaPointerAttributes attr{};
  CHUNKSTAR_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  CHECK(attr.type == cudaMemoryTypeDevice);
  CHECK(attr.device == 0);
  d.deallocate(p, mib, 4096);
}

TEST_CASE("CHUNKSTAR_CUDA_CHECK: names the call and the CUDA error; OOM is typed") {
  try {
    CHUNKSTAR_CUDA_CHECK(cudaSetDevice(100000));
    FAIL("an invalid device must throw");
  } catch (const cuda::cuda_error& e) {
    const std::string what = e.what();
    CHECK(what.find("cudaSetDevice(100000)") != std::string::npos);
    CHECK(what.find(cudaGetErrorString(e.code())) != std::string::npos);
    CHECK(e.code() != cudaSuccess);
  }
  (void)cudaGetLastError();
  void* p = nullptr;
  CHECK_THROWS_AS(CHUNKSTAR_CUDA_CHECK(cudaMalloc(&p, std::size_t{1} << 60)), out_of_memory_error);
  CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace memory_space_test
