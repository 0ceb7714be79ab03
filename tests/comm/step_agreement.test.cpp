// SPDX-License-Identifier: Apache-2.0
// step_agreement: every step's arguments compared across ranks inside an allreduce; chunk_adam's
// step under ZeRO (the norm's allreduce carries them) and replicated data parallelism (an allreduce
// of their own): a rank passing another lr or micro-batch count at a later step stops every rank
// with the same error, before anything is updated, instead of diverging silently.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/step_agreement.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include "support/runtimes.hpp"
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace chunkstar;

namespace step_agreement_test {

TEST_CASE("first_step_disagreement: the first argument, then the first rank, that differs from rank 0's") {
  // Two arguments over three ranks, rank-major.
  const std::vector<double> alike = {1, 2, 1, 2, 1, 2};
  CHECK_FALSE(first_step_disagreement(alike, 2, 3).has_value());
  const std::vector<double> second = {1, 2, 1, 2, 1, 5};
  CHECK(first_step_disagreement(second, 2, 3) == std::pair<std::size_t, int>{1, 2});
  const std::vector<double> both = {1, 2, 1, 7, 9, 2};  // argument 0 differs on rank 2, argument 1 on rank 1
  CHECK(first_step_disagreement(both, 2, 3) == std::pair<std::size_t, int>{0, 2});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> nans = {nan, 1, nan, 1};
  CHECK_FALSE(first_step_disagreement(nans, 2, 2).has_value());
  CHECK(first_step_disagreement(std::vector<double>{1}, 1, 1) == std::nullopt);
}

TEST_CASE("step_agreement: each rank's values in its own slots; the sum holds all of them exactly") {
  const step_agreement a("t", {{"lr", 0.1f}, {"n", 3}}, 1, 3);
  std::vector<double> slots(a.slots(), -1.0);
  CHECK(slots.size() == 6);
  a.fill(slots);
  CHECK(slots == std::vector<double>{0, 0, static_cast<double>(0.1f), 3, 0, 0});
}

TEST_CASE("step_agreement::run: alike, nothing; one rank different, the same config_error on every rank") {
  std::vector<std::string> messages(3);
  run_ranks(3, [&](in_process_communicator& comm) {
    step_agreement("alike", {{"lr", 1e-3f}, {"micro_batches", 2}}, comm.rank(), comm.size()).run(comm);
    try {
      const double mb = comm.rank() == 2 ? 4 : 2;
      step_agreement("my_step", {{"lr", 1e-3f}, {"micro_batches", mb}}, comm.rank(), comm.size()).run(comm);
    } catch (const config_error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& m : messages) {
    CAPTURE(m);
    CHECK(m == messages[0]);
    CHECK(m.find("my_step: the ranks' step arguments differ: rank 0 passes micro_batches 2 but rank 2 passes "
                 "micro_batches 4") != std::string::npos);
  }
}

namespace {

using runtime_t = testing::fixed_group_runtime;

struct model {
  simulated_device_space dev{{.capacity = 1 << 20}};
  host_space host;
  host_copy_engine copier;
  runtime_t rt;
  param_id w;
  model(in_process_communicator& comm, runtime_options options)
      : rt(dev, host, copier, comm, options, fixed_chunk_layout({.chunk_elems = 256, .align_elems = 32})),
        w(rt.register_param({"w0", {12, 12}, dtype::f32, tensor_role::weight},
                            [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); })) {
    rt.finalize();
  }
};

struct outcome {
  std::vector<std::string> messages;  // per rank: the error, empty when every step passed
  std::vector<int> failed_at;         // per rank: the step that threw (0: none)
  std::vector<float> weight;          // per rank: w[0] after the last step stepped (or the throw)
};

/** Five steps on 3 ranks; @p vary may change rank r's lr and micro-batches at step s. */
outcome train(runtime_options options, chunk_adam_options adam,
              const std::function<void(int rank, int step, float& lr, int& micro_batches)>& vary) {
  outcome o{std::vector<std::string>(3), std::vector<int>(3, 0), std::vector<float>(3, 0)};
  run_ranks(3, [&](in_process_communicator& comm) {
    model m(comm, options);
    chunk_adam<> opt(adam);
    const auto me = static_cast<std::size_t>(comm.rank());
    for (int s = 1; s <= 5; ++s) {
      float lr = 1e-2f;
      int micro_batches = 3;
      vary(comm.rank(), s, lr, micro_batches);
      { auto f = m.rt.forward("f", {m.w}); }
      {
        auto b = m.rt.backward("b", {m.w});
        for (float& g : b.grad<float>(m.w)) g = 0.25f;
      }
      if (options.gradients == gradient_mode::replicated)  // the same on every rank: as if all-reduced
        for (std::uint32_t c = 0; c < m.rt.plan().num_chunks; ++c) m.rt.gradient_reduced(c);
      try {
        (void)opt.step(m.rt, lr, micro_batches);
      } catch (const config_error& e) {
        o.messages[me] = e.what();
        o.failed_at[me] = s;
        break;
      }
    }
    if (m.rt.owner(m.w) == comm.rank()) {
      std::vector<float> w(144);
      m.rt.read_tensor(m.w, chunk_kind::param, w);
      o.weight[me] = w[0];
    }
  });
  return o;
}

}  // namespace

TEST_CASE("chunk_adam::step: another lr or micro-batch count on one rank at a later step stops every rank there") {
  const runtime_options zero{.sharding = {.enabled = true}}, replicated{.gradients = gradient_mode::replicated};
  struct mode {
    const char* name;
    runtime_options options;
    chunk_adam_options adam;
  };
  for (const mode& md : {mode{"ZeRO, clipping: in the norm's allreduce", zero, {.max_grad_norm = 1.0f}},
                         mode{"ZeRO, no norm scanned: an allreduce of their own", zero, {.report_norm = false}},
                         mode{"replicated", replicated, {.max_grad_norm = 1.0f}}}) {
    CAPTURE(std::string(md.name));
    const outcome alike = train(md.options, md.adam, [](int, int, float&, int&) {});
    for (int r = 0; r < 3; ++r) CHECK(alike.failed_at[static_cast<std::size_t>(r)] == 0);

    const outcome lr = train(md.options, md.adam, [](int r, int s, float& l, int&) {
      if (r == 1 && s >= 3) l = 2e-2f;  // a schedule that went its own way
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      CHECK(lr.failed_at[static_cast<std::size_t>(r)] == 3);
      CHECK(lr.messages[static_cast<std::size_t>(r)] == lr.messages[0]);
    }
    CHECK(lr.messages[0].find("chunk_adam::step: the ranks' step arguments differ: rank 0 passes lr 0.01 but rank 1 "
                              "passes lr 0.02") != std::string::npos);
    // Nothing was updated by the refused step: the weights are those after two steps, as if it never ran.
    const outcome two = train(md.options, md.adam, [](int, int s, float&, int& mb) {
      if (s >= 3) mb = -1;  // refused by step() itself before anything: stops at step 3 too
    });
    CHECK(lr.weight == two.weight);

    const outcome micro = train(md.options, md.adam, [](int r, int s, float&, int& mb) {
      if (r == 2 && s >= 4) mb = 2;
    });
    for (int r = 0; r < 3; ++r) CHECK(micro.failed_at[static_cast<std::size_t>(r)] == 4);
    CHECK(micro.messages[0].find("rank 0 passes micro_batches 3 but rank 2 passes micro_batches 2") !=
          std::string::npos);
  }
}

}  // namespace step_agreement_test
