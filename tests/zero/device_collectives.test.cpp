// SPDX-License-Identifier: Apache-2.0
// What the runtime gives a device communicator (NCCL): model data in device memory for every void*
// collective, and everything about the run (rank agreement, gradient norms, a checkpoint's
// directory) as host doubles through allreduce(span<double>). Checked on the CPU with a test double
// that faults, as NCCL would, on any void* buffer outside a (simulated) device's live blocks; the
// results must be those of the same ranks over the plain in-process communicator, bit for bit.
// The same through staged_communicator over a host-only double (an MPI without CUDA support), and
// the stream contract: a reduction never reads gradients the user's stream may still be writing.
#include <chunkstar/comm/blocking_collectives.hpp>
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/host_scalars.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/staged_communicator.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "support/device_memory_communicator.hpp"
#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"
#include "support/scripted_copy_engine.hpp"

using namespace chunkstar;

namespace device_collectives_test {
using chunkstar::testing::device_buffer_error;
using chunkstar::testing::device_memory_communicator;
using chunkstar::testing::host_buffer_error;
using chunkstar::testing::host_memory_communicator;
using chunkstar::testing::mlp_adam;
using chunkstar::testing::mlp_replica;
using chunkstar::testing::tracked_device_space;
using chunkstar::testing::tracked_platform;
namespace fs = std::filesystem;

TEST_CASE("broadcast_scalars and broadcast_string: the root's values on every rank, exactly") {
  run_ranks(3, [](in_process_communicator& comm) {
    std::vector<double> v = {9007199254740991.0, -1.5, 0.1, std::numeric_limits<double>::denorm_min(), 4294967295.0};
    if (comm.rank() != 1) v.assign(v.size(), static_cast<double>(comm.rank() + 7));
    broadcast_scalars(comm, std::span<double>(v), 1);
    CHECK(v ==
          std::vector<double>{9007199254740991.0, -1.5, 0.1, std::numeric_limits<double>::denorm_min(), 4294967295.0});
    std::string bytes;
    for (int c = 0; c < 256; ++c) bytes += static_cast<char>(c);  // every byte, NUL and 0xff included
    const std::string got = broadcast_string(comm, comm.rank() == 2 ? bytes : std::string("not the root's"), 2);
    CHECK(got == bytes);
    CHECK(broadcast_string(comm, comm.rank() == 0 ? std::string() : std::string("x"), 0).empty());
  });
  single_process_communicator one;
  CHECK(broadcast_string(one, "alone", 0) == "alone");
}

TEST_CASE(
    "device_memory_communicator: device buffers pass, a host buffer is the error NCCL's illegal address would be") {
  run_ranks(2, [](in_process_communicator& inner) {
    device_memory_communicator comm(inner);
    tracked_device_space dev({.capacity = 1 << 20});
    auto* send = static_cast<float*>(dev.allocate(4 * sizeof(float), 64));
    auto* recv = static_cast<float*>(dev.allocate(8 * sizeof(float), 64));
    for (int i = 0; i < 4; ++i) send[i] = static_cast<float>(comm.rank() * 10 + i);
    comm.allgather(send, recv, 4 * sizeof(float));
    CHECK(recv[5] == 11.0f);
    CHECK(comm.checked() == 2);
    std::vector<float> host(8);
    CHECK_THROWS_AS(comm.allgather(host.data(), recv, 4 * sizeof(float)), host_buffer_error);
    CHECK_THROWS_AS(comm.allgather(send, recv + 4, 4 * sizeof(float)), host_buffer_error);  // runs past the block
    double d = 1;
    comm.allreduce(std::span<double>(&d, 1), reduce_op::sum);  // host scalars: always fine
    CHECK(d == 2);
    dev.deallocate(send, 4 * sizeof(float), 64);
    CHECK_THROWS_AS(comm.broadcast(send, 4, 0), host_buffer_error);  // freed: no longer device memory
    dev.deallocate(recv, 8 * sizeof(float), 64);
  });
}

TEST_CASE(
    "staged_communicator: device buffers reach a host-only communicator as host copies, results come back to the "
    "device") {
  run_ranks(2, [](in_process_communicator& inner) {
    host_memory_communicator host_only(inner);
    tracked_device_space dev({.capacity = 1 << 20});
    auto* send = static_cast<float*>(dev.allocate(4 * sizeof(float), 64));
    auto* recv = static_cast<float*>(dev.allocate(8 * sizeof(float), 64));
    for (int i = 0; i < 4; ++i) send[i] = static_cast<float>(host_only.rank() * 10 + i);
    CHECK_THROWS_AS(host_only.allgather(send, recv, 4 * sizeof(float)), device_buffer_error);  // what staging avoids
    staged_communicator<host_memory_communicator> comm(host_only);
    static_assert(takes_device_memory_v<decltype(comm)>);
    auto h = comm.allgather_async(send, recv, 4 * sizeof(float));
    h.wait();
    CHECK(recv[1] == 1.0f);
    CHECK(recv[5] == 11.0f);
    comm.reduce_scatter(recv, send, 4, dtype::f32, reduce_op::sum);  // block r of both ranks' recv, summed
    CHECK(send[0] == 2.0f * recv[4 * comm.rank()]);
    comm.broadcast(recv, 8 * sizeof(float), 1);
    comm.ring_shift(send, recv, 4 * sizeof(float));
    comm.reduce(send, send, 4, dtype::f32, reduce_op::max, 0);
    CHECK(host_only.checked() > 0);
    CHECK(comm.staged_bytes().first > 0);
    CHECK(comm.staged_bytes().second > 0);
    dev.deallocate(send, 4 * sizeof(float), 64);
    dev.deallocate(recv, 8 * sizeof(float), 64);
  });
}

namespace {

constexpr int steps = 6;

struct rank_run {
  std::vector<float> losses;
  std::vector<float> params;  // the rank's own parameter tensors after the last step
  std::size_t checked = 0;    // void* collectives the device communicator checked
};

/** Over which communicator: the plain in-process one; the device-only double; or host memory only
 *  (an MPI without CUDA support) behind a staged_communicator, which hands it host copies. */
enum class transport { plain, device_only, staged };

/** ZeRO on 3 ranks: @p steps steps, a sharded checkpoint, then every rank loads it into a fresh
 *  runtime and trains one more step, over @p how. */
std::vector<rank_run> train(transport how, runtime_options options, std::size_t capacity, const fs::path& dir) {
  std::vector<rank_run> out(3);
  run_ranks(3, [&](in_process_communicator& inner) {
    auto& me = out[static_cast<std::size_t>(inner.rank())];
    const auto body = [&](auto& comm, auto platform_tag) {
      using Comm = std::remove_reference_t<decltype(comm)>;
      using P = decltype(platform_tag);
      {
        mlp_replica<Comm, auto_placement, belady_eviction, P> r(options, capacity, comm);
        auto opt = mlp_adam();
        for (int step = 1; step <= steps; ++step) {
          me.losses.push_back(r.forward_backward(step, comm.rank(), [] {}));
          REQUIRE(opt.step(r.rt, 2e-2f, comm.size()).stepped);
        }
        save_checkpoint(r.rt, dir, {{"optimizer_steps", std::to_string(opt.step_count())}});
      }
      mlp_replica<Comm, auto_placement, belady_eviction, P> r(options, capacity, comm);
      auto opt = mlp_adam();
      opt.restore_step_count(std::stoll(load_checkpoint(r.rt, dir).at("optimizer_steps")));
      me.losses.push_back(r.forward_backward(steps + 1, comm.rank(), [] {}));
      REQUIRE(opt.step(r.rt, 2e-2f, comm.size()).stepped);
      me.params = r.owned(chunk_kind::param);
      if constexpr (requires { comm.checked(); }) me.checked = comm.checked();
    };
    if (how == transport::device_only) {
      device_memory_communicator comm(inner);
      body(comm, tracked_platform{});
    } else if (how == transport::staged) {
      host_memory_communicator host_only(inner);
      staged_communicator<host_memory_communicator> comm(host_only);
      body(comm, tracked_platform{});
      me.checked = host_only.checked();
    } else {
      body(inner, simulated_platform{});
    }
  });
  return out;
}

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("chunkstar_device_collectives_" + std::to_string(::getpid()));
  temp_dir() { fs::remove_all(path); }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE(
    "ZeRO through a device-only communicator, and through a host-only one behind staging: agreement, gathers, "
    "reductions, clipping and checkpoints use device memory or host doubles; same bits") {
  temp_dir tmp;
  for (bool memory_saving : {false, true}) {
    for (std::size_t capacity :
         {std::size_t{1} << 20, chunkstar::testing::mlp_act_bytes + 6 * chunkstar::testing::mlp_chunk_bytes}) {
      for (bool keep : {false, true}) {
        CAPTURE(memory_saving);
        CAPTURE(capacity);
        CAPTURE(keep);
        if (!memory_saving && capacity < (std::size_t{1} << 20)) continue;  // group buffers need more at 3 ranks
        const runtime_options options{
            .sharding = {.enabled = true, .keep_gathered = keep, .memory_saving = memory_saving}};
        const auto expected = train(transport::plain, options, capacity, tmp.path / "plain");
        for (transport how : {transport::device_only, transport::staged}) {
          CAPTURE(static_cast<int>(how));
          const auto got = train(how, options, capacity, tmp.path / "device");
          for (std::size_t k = 0; k < got.size(); ++k) {
            CAPTURE(k);
            CHECK(got[k].checked > 0);
            CHECK(got[k].losses == expected[k].losses);
            CHECK(!got[k].params.empty());
            CHECK(got[k].params == expected[k].params);
          }
        }
      }
    }
  }
}

TEST_CASE(
    "Ranks configured differently: the same config_error through a device-only communicator (host doubles only)") {
  std::vector<std::string> messages(3);
  run_ranks(3, [&](in_process_communicator& inner) {
    device_memory_communicator comm(inner);
    using runtime_t = chunk_runtime<fixed_chunk_layout, auto_placement, belady_eviction, warmup_tracer,
                                    device_memory_communicator, tracked_platform>;
    tracked_device_space dev({.capacity = 1 << 20});
    host_space host;
    host_copy_engine copier;
    runtime_t rt(dev, host, copier, comm, {.sharding = {.enabled = true}},
                 fixed_chunk_layout({.chunk_elems = 256, .align_elems = 32}));
    rt.register_param({"w0", {12, 12}, dtype::f32, tensor_role::weight});
    rt.register_param(
        {"w1", {12, comm.rank() == 2 ? std::int64_t{13} : std::int64_t{12}}, dtype::f32, tensor_role::weight});
    try {
      rt.finalize();
    } catch (const config_error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& m : messages) {
    CHECK(m.find("rank 0 has parameter 1 = 'w1' [12, 12] f32 weight") != std::string::npos);
    CHECK(m.find("rank 2 has parameter 1 = 'w1' [12, 13] f32 weight") != std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------------
// The stream contract under ZeRO: a backward scope closed on a stream hands back kernels that may
// still be writing its gradients, and a device communicator reads them on its own stream (NCCL) or
// from the host (staging), ordered after nothing of the user's. So the runtime must wait for that
// work before a reduction reads the buffer. The scripted engine leaves every user handle unfinished
// until something waits for it; the communicator below faults when a collective's buffer overlaps
// gradients whose user work has not finished.
namespace {

using chunkstar::testing::scripted_copy_handle;
using chunkstar::testing::scripted_platform;
using chunkstar::testing::scripted_stream;

/** In-process rank that checks every void* buffer against the user work still pending on it. */
class stream_checked_communicator : public blocking_collectives<stream_checked_communicator> {
 public:
  explicit stream_checked_communicator(in_process_communicator& inner) : inner_(inner) {}
  /** The user's work up to @p done writes @p bytes at @p p. */
  void note(const void* p, std::size_t bytes, scripted_copy_handle done) {
    pending_.push_back({p, bytes, std::move(done)});
  }
  [[nodiscard]] std::size_t checked() const noexcept { return checked_; }

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  void barrier() { inner_.barrier(); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    check("allreduce", p, n * dtype_size(t));
    return inner_.allreduce_async(p, n, t, op);
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return inner_.allreduce_async(d, op); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) {
    check("allgather", s, n);
    check("allgather", r, n * static_cast<std::size_t>(size()));
    return inner_.allgather_async(s, r, n);
  }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    check("reduce_scatter", s, n * dtype_size(t) * static_cast<std::size_t>(size()));
    return inner_.reduce_scatter_async(s, r, n, t, op);
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    check("reduce", s, n * dtype_size(t));
    return inner_.reduce_async(s, r, n, t, op, root);
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) {
    check("broadcast", p, n);
    return inner_.broadcast_async(p, n, root);
  }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    check("ring_shift", s, n);
    return inner_.ring_shift_async(s, r, n);
  }

 private:
  struct write {
    const void* p;
    std::size_t bytes;
    scripted_copy_handle done;
  };
  void check(const char* call, const void* p, std::size_t n) {
    std::erase_if(pending_, [](const write& w) { return w.done.ready(); });
    for (const auto& w : pending_)
      if (chunkstar::detail::overlaps(p, n, w.p, w.bytes))
        throw std::logic_error(
            std::string(call) +
            " read a buffer that the user's stream may still be writing (a backward scope closed on it)");
    ++checked_;
  }
  in_process_communicator& inner_;
  std::vector<write> pending_;
  std::size_t checked_ = 0;
};

}  // namespace

TEST_CASE(
    "ZeRO with backward scopes closed on a stream: a reduction waits for the user's work on its gradients; same bits") {
  for (bool memory_saving : {false, true}) {
    CAPTURE(memory_saving);
    const runtime_options options{.sharding = {.enabled = true, .memory_saving = memory_saving}};
    std::vector<rank_run> expected(3), got(3);
    std::vector<std::size_t> stalls(3);
    run_ranks(3, [&](in_process_communicator& inner) {
      auto& me = expected[static_cast<std::size_t>(inner.rank())];
      mlp_replica<in_process_communicator> r(options, std::size_t{1} << 20, inner);
      auto opt = mlp_adam();
      for (int step = 1; step <= 3; ++step) {
        me.losses.push_back(r.forward_backward(step, inner.rank(), [] {}));
        REQUIRE(opt.step(r.rt, 2e-2f, inner.size()).stepped);
      }
      me.params = r.owned(chunk_kind::param);
    });
    run_ranks(3, [&](in_process_communicator& inner) {
      auto& me = got[static_cast<std::size_t>(inner.rank())];
      stream_checked_communicator comm(inner);
      mlp_replica<stream_checked_communicator, auto_placement, belady_eviction, scripted_platform> r(
          options, std::size_t{1} << 20, comm);
      const scripted_stream stream{7};
      r.close_backward = [&](auto& scope, std::span<float> gW, std::span<float> gb) {
        scope.close(stream);  // the "kernels" stay unfinished until the runtime waits for them
        const auto done = r.copier.user_handles(stream).back();
        comm.note(gW.data(), gW.size_bytes(), done);
        comm.note(gb.data(), gb.size_bytes(), done);
      };
      auto opt = mlp_adam();
      for (int step = 1; step <= 3; ++step) {
        me.losses.push_back(r.forward_backward(step, comm.rank(), [] {}));
        REQUIRE(opt.step(r.rt, 2e-2f, comm.size()).stepped);
      }
      me.params = r.owned(chunk_kind::param);
      me.checked = comm.checked();
      stalls[static_cast<std::size_t>(comm.rank())] = r.copier.stalls().size();
    });
    for (std::size_t k = 0; k < got.size(); ++k) {
      CAPTURE(k);
      CHECK(got[k].checked > 0);
      CHECK(stalls[k] > 0);  // the runtime waited for the user's work: nothing else finishes it
      CHECK(got[k].losses == expected[k].losses);
      CHECK(!got[k].params.empty());
      CHECK(got[k].params == expected[k].params);
    }
  }
}

}  // namespace device_collectives_test
