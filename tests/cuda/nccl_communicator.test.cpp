// SPDX-License-Identifier: Apache-2.0
// nccl_communicator: the Communicator conformance suite on one rank with device buffers
// (bootstrapped over single_process_communicator, as production bootstraps over MPI).
// Skips (exit 77) without a GPU, through the shared CUDA test main.
#include <chunkstar/config.hpp>

#include <doctest/doctest.h>

#if CHUNKSTAR_HAS_NCCL()

#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/nccl/nccl_communicator.hpp>

#include "support/comm_conformance.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace nccl_communicator_test {

namespace {

using namespace chunkstar;

static_assert(Communicator<nccl::nccl_communicator>);
static_assert(!std::copyable<nccl::nccl_communicator>);

void cuda_ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}

/** @brief Device memory as a conformance-suite buffer. */
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    cuda_ok(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), "cudaMalloc");
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { cudaFree(data_); }
  void* data() noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  void write(const void* src, std::size_t n, std::size_t offset = 0) {
    if (n != 0)
      cuda_ok(cudaMemcpy(static_cast<std::byte*>(data_) + offset, src, n, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  [[nodiscard]] std::vector<std::byte> read() const {
    std::vector<std::byte> out(bytes_);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (bytes_ != 0) cuda_ok(cudaMemcpy(out.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return out;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

nccl::nccl_communicator& single_rank() {
  static single_process_communicator host;
  static nccl::nccl_communicator comm = nccl::nccl_communicator::bootstrap(host);
  return comm;
}

struct nccl_fixture {
  using buffer = device_buffer;
  // NCCL reduces in its own order; with one rank the reduction is a copy and checks come out
  // exact anyway, but the fixture states the model's contract: tolerance, not bits.
  static constexpr bool exact = false;
  template <class Body>
  static void run(Body&& body) {
    body(single_rank());
  }
};

}  // namespace

CHUNKSTAR_COMM_CONFORMANCE(nccl_fixture);

TEST_CASE("nccl_communicator: one rank, rank 0, on the current device") {
  auto& comm = single_rank();
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  int device = -1;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  CHECK(comm.device() == device);
  CHECK(comm.stream() != nullptr);
  CHECK(comm.native() != nullptr);
}

}  // namespace nccl_communicator_test

#endif  // CHUNKSTAR_HAS_NCCL()
