// SPDX-License-Identifier: Apache-2.0
// A program built for CUDA, run where the device it names cannot be used (no GPU at all, as on CI's
// machines, or an ordinal past the last one): the first CUDA object a user builds says so in its
// error, naming the ordinal, the devices this process sees and the ways out. Runs with or without
// a GPU (the ordinal is past any machine's count), so it is a plain unit test.
#include <doctest/doctest.h>

#include <chunkstar/cuda/cuda_copy_engine.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/device_space.hpp>

#include <string>

namespace device_unusable_test {
using namespace chunkstar;

constexpr int absent = 1000;

void check_message(const std::string& what) {
  INFO(what);
  CHECK(what.find("CUDA device 1000 cannot be used") != std::string::npos);
  CHECK(what.find("this process sees") != std::string::npos);
  CHECK(what.find("CUDA_VISIBLE_DEVICES") != std::string::npos);
  CHECK(what.find("simulated_platform") != std::string::npos);
}

TEST_CASE("a device space on a device that cannot be used: a cuda_error naming it and the ways out") {
  try {
    cuda::device_space d(cuda::device_space_options{.device = absent});
    FAIL("a device space on ordinal 1000 must throw");
  } catch (const cuda::cuda_error& e) {
    CHECK(e.code() != cudaSuccess);
    check_message(e.what());
  }
}

TEST_CASE("a copy engine on a device that cannot be used: the same error") {
  try {
    cuda::cuda_copy_engine engine(absent);
    FAIL("a copy engine on ordinal 1000 must throw");
  } catch (const cuda::cuda_error& e) {
    check_message(e.what());
  }
}

TEST_CASE("the guard leaves the caller's device as it was after refusing") {
  int before = -1;
  const bool has_device = cudaGetDevice(&before) == cudaSuccess;
  (void)cudaGetLastError();
  CHECK_THROWS_AS(cuda::device_guard{absent}, cuda::cuda_error);
  if (has_device) {
    int after = -2;
    CHECK(cudaGetDevice(&after) == cudaSuccess);
    CHECK(after == before);
  }
}

}  // namespace device_unusable_test
