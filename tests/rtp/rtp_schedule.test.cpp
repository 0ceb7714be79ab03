// SPDX-License-Identifier: Apache-2.0
// The RTP schedule (rtp/ring_order.hpp, rtp/rotation.hpp, rtp/replicated.hpp) as a user sees it:
// the ring order's laws checked exhaustively; on 1-4 in-process ranks, which shard each kernel
// sees, that an evaluation pass leaves the owned shard bit-unchanged, and that a shard's gradient
// arrives at its owner summed in the documented rank order; overlap and double buffering through
// a recording communicator; bytes against comm_stats; and faults (a throwing kernel, a failing
// communicator at every call) leaving the owned buffers as they were and nobody hanging.
#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/ring_order.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace rtp_schedule_test {

namespace {

using namespace chunkstar;
using rtp::rotation;

constexpr std::size_t elems = 7;  // odd, so nothing lines up by accident

/** Shard j's weights, as its owner fills them: distinct per shard and element. */
float weight_value(int shard, std::size_t i) {
  return static_cast<float>(shard) * 100.0f + static_cast<float>(i) * 0.25f;
}

/** What rank r's kernel adds to shard j's gradient at element i: not exactly representable
 *  sums, so the order of addition shows in the bits. */
float contribution(int rank, int shard, std::size_t i) {
  return 0.1f * static_cast<float>(rank + 1) + 0.013f * static_cast<float>(shard) + 1e-3f * static_cast<float>(i * i) +
         1.0f / 3.0f;
}

template <class Rot>
void fill_owned(Rot& rot) {
  for (std::size_t i = 0; i < rot.shard_elems(); ++i) rot.owned()[i] = weight_value(rot.rank(), i);
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

bool holds_shard(std::span<const float> data, int shard) {
  for (std::size_t i = 0; i < data.size(); ++i)
    if (data[i] != weight_value(shard, i)) return false;
  return true;
}

// ---- a recording communicator: every ring shift's start and wait, the buffers in flight -----

struct ring_log {
  struct event {
    enum kind_t { start, wait, kernel } kind;
    int id = -1;     // shift id (start, wait)
    int shard = -1;  // kernel
  };
  struct flight {
    int id;
    const std::byte* send;
    const std::byte* recv;
    std::size_t bytes;
  };
  std::vector<event> events;
  std::vector<flight> in_flight;
  std::vector<std::string> violations;
  int next_id = 0;

  static bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
    const auto* x = static_cast<const std::byte*>(a);
    const auto* y = static_cast<const std::byte*>(b);
    return x < y + bn && y < x + an;
  }
  /** A kernel may read its shard while it is being sent, never while one is being received into
   *  it; it may write its gradient buffer only while no shift reads or writes it. */
  void kernel(int shard, const void* data, const void* grad, std::size_t bytes) {
    events.push_back({event::kernel, -1, shard});
    for (const auto& f : in_flight) {
      if (overlaps(data, bytes, f.recv, f.bytes))
        violations.push_back("kernel of shard " + std::to_string(shard) + " reads a buffer shift " +
                             std::to_string(f.id) + " is receiving into");
      if (grad != nullptr && (overlaps(grad, bytes, f.recv, f.bytes) || overlaps(grad, bytes, f.send, f.bytes)))
        violations.push_back("kernel of shard " + std::to_string(shard) + " writes a buffer shift " +
                             std::to_string(f.id) + " uses");
    }
  }
};

class recording_ring {
 public:
  recording_ring(in_process_communicator& c, ring_log& log) : c_(c), log_(log) {}
  [[nodiscard]] int rank() const { return c_.rank(); }
  [[nodiscard]] int size() const { return c_.size(); }
  void allreduce(void* p, std::size_t n, dtype t, reduce_op op) { c_.allreduce(p, n, t, op); }
  void allreduce(std::span<double> d, reduce_op op) { c_.allreduce(d, op); }
  void allgather(const void* s, void* r, std::size_t n) { c_.allgather(s, r, n); }
  void reduce_scatter(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    c_.reduce_scatter(s, r, n, t, op);
  }
  void reduce(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    c_.reduce(s, r, n, t, op, root);
  }
  void broadcast(void* p, std::size_t n, int root) { c_.broadcast(p, n, root); }
  void ring_shift(const void* s, void* r, std::size_t n) {
    log_.violations.push_back("a blocking ring_shift: nothing can overlap it");
    c_.ring_shift(s, r, n);
  }
  void barrier() { c_.barrier(); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) { return c_.allreduce_async(p, n, t, op); }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return c_.allreduce_async(d, op); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) { return c_.allgather_async(s, r, n); }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    return c_.reduce_scatter_async(s, r, n, t, op);
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    return c_.reduce_async(s, r, n, t, op, root);
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) { return c_.broadcast_async(p, n, root); }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    const int id = log_.next_id++;
    if (ring_log::overlaps(s, n, r, n))
      log_.violations.push_back("shift " + std::to_string(id) + " sends from and receives into the same buffer");
    for (const auto& f : log_.in_flight)
      if (ring_log::overlaps(r, n, f.recv, f.bytes) || ring_log::overlaps(r, n, f.send, f.bytes) ||
          ring_log::overlaps(s, n, f.recv, f.bytes))
        log_.violations.push_back("shift " + std::to_string(id) + " touches a buffer of shift " + std::to_string(f.id) +
                                  ", still in flight");
    log_.events.push_back({ring_log::event::start, id, -1});
    log_.in_flight.push_back({id, static_cast<const std::byte*>(s), static_cast<const std::byte*>(r), n});
    return comm_handle(std::make_shared<logged>(c_.ring_shift_async(s, r, n), log_, id));
  }

 private:
  struct logged {
    comm_handle inner;
    ring_log& log;
    int id;
    logged(comm_handle h, ring_log& l, int i) : inner(std::move(h)), log(l), id(i) {}
    void wait() {
      inner.wait();
      log.events.push_back({ring_log::event::wait, id, -1});
      std::erase_if(log.in_flight, [&](const ring_log::flight& f) { return f.id == id; });
    }
    bool ready() { return inner.ready(); }
  };
  in_process_communicator& c_;
  ring_log& log_;
};
static_assert(Communicator<recording_ring>);

/** The kernel calls between each shift's start and its wait. */
std::vector<int> kernels_overlapping(const ring_log& log) {
  std::vector<int> out(static_cast<std::size_t>(log.next_id), -1);
  std::vector<int> kernels_before(static_cast<std::size_t>(log.next_id), 0);
  int kernels = 0;
  for (const auto& e : log.events) {
    if (e.kind == ring_log::event::kernel) ++kernels;
    else if (e.kind == ring_log::event::start) kernels_before[static_cast<std::size_t>(e.id)] = kernels;
    else out[static_cast<std::size_t>(e.id)] = kernels - kernels_before[static_cast<std::size_t>(e.id)];
  }
  return out;
}

// ---- a scripted ring for faults: one rank of a pretend ring whose shifts land at wait() ----

/** Rank 0 of a ring of `size` whose neighbours hold what this rank holds (a shift copies send to
 *  recv, when waited for), and which fails its `fail_at`-th shift, at the call or at the wait. */
class scripted_ring {
 public:
  explicit scripted_ring(int size) : size_(size) {}
  int fail_at = -1;
  bool fail_in_wait = false;
  int shifts = 0;
  int outstanding = 0;

  [[nodiscard]] int rank() const { return 0; }
  [[nodiscard]] int size() const { return size_; }
  void allreduce(void*, std::size_t, dtype, reduce_op) {}
  void allreduce(std::span<double>, reduce_op) {}
  void allgather(const void*, void*, std::size_t) {}
  void reduce_scatter(const void*, void*, std::size_t, dtype, reduce_op) {}
  void reduce(const void*, void*, std::size_t, dtype, reduce_op, int) {}
  void broadcast(void*, std::size_t, int) {}
  void ring_shift(const void* s, void* r, std::size_t n) { ring_shift_async(s, r, n).wait(); }
  void barrier() {}
  comm_handle allreduce_async(void*, std::size_t, dtype, reduce_op) { return {}; }
  comm_handle allreduce_async(std::span<double>, reduce_op) { return {}; }
  comm_handle allgather_async(const void*, void*, std::size_t) { return {}; }
  comm_handle reduce_scatter_async(const void*, void*, std::size_t, dtype, reduce_op) { return {}; }
  comm_handle reduce_async(const void*, void*, std::size_t, dtype, reduce_op, int) { return {}; }
  comm_handle broadcast_async(void*, std::size_t, int) { return {}; }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) {
    const int k = shifts++;
    if (k == fail_at && !fail_in_wait)
      throw communication_error("scripted: shift " + std::to_string(k) + " failed at the call");
    ++outstanding;
    return comm_handle(std::make_shared<pending>(*this, s, r, n, k == fail_at));
  }

 private:
  struct pending {
    scripted_ring& ring;
    const void* send;
    void* recv;
    std::size_t bytes;
    bool fail;
    pending(scripted_ring& g, const void* s, void* r, std::size_t n, bool f)
        : ring(g), send(s), recv(r), bytes(n), fail(f) {}
    void wait() {
      --ring.outstanding;
      if (fail) throw communication_error("scripted: a shift failed in flight");
      std::memcpy(recv, send, bytes);  // lands only now: a kernel reading it early would see stale data
    }
    bool ready() { return false; }
  };
  int size_;
};
static_assert(Communicator<scripted_ring>);

struct injected_error : std::runtime_error {
  injected_error() : std::runtime_error("injected kernel failure") {}
};

}  // namespace

TEST_CASE("ring order: forward and backward visit every shard once, consistently with a one-way ring") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    for (int s = 0; s < n; ++s) {
      std::set<int> fwd_at_step, bwd_at_step;
      for (int r = 0; r < n; ++r) {
        fwd_at_step.insert(rtp::forward_shard(r, n, s));
        bwd_at_step.insert(rtp::backward_shard(r, n, s));
        if (s + 1 < n) {  // what arrives at r for the next step is what r - 1 holds now (shift to rank + 1)
          CHECK(rtp::forward_shard(r, n, s + 1) == rtp::forward_shard((r - 1 + n) % n, n, s));
          CHECK(rtp::backward_shard(r, n, s + 1) == rtp::backward_shard((r - 1 + n) % n, n, s));
        }
      }
      CHECK(fwd_at_step.size() == static_cast<std::size_t>(n));  // every shard resident exactly once per step
      CHECK(bwd_at_step.size() == static_cast<std::size_t>(n));
    }
    for (int r = 0; r < n; ++r) {
      std::set<int> fwd, bwd;
      for (int s = 0; s < n; ++s) fwd.insert(rtp::forward_shard(r, n, s)), bwd.insert(rtp::backward_shard(r, n, s));
      CHECK(fwd.size() == static_cast<std::size_t>(n));
      CHECK(bwd.size() == static_cast<std::size_t>(n));
      CHECK(rtp::forward_shard(r, n, 0) == r);       // forward starts at home: no shift before it
      CHECK(rtp::backward_shard(r, n, n - 1) == r);  // backward ends at home: the gradient arrives there
      if (n > 1)
        CHECK(rtp::backward_shard(r, n, 0) == rtp::forward_shard((r - 1 + n) % n, n, 0));  // fetched from r - 1
    }
    for (int j = 0; j < n; ++j) {
      std::set<int> contributors;
      for (int k = 0; k < n; ++k) {
        const int c = rtp::gradient_contributor(j, n, k);
        CHECK(rtp::backward_shard(c, n, k) == j);  // the k-th term is added by whoever holds j at step k
        contributors.insert(c);
      }
      CHECK(contributors.size() == static_cast<std::size_t>(n));
      CHECK(rtp::gradient_contributor(j, n, n - 1) == j);  // the owner adds last
    }
    CHECK(rtp::forward_traffic(n, 40) == rtp::pass_traffic{n - 1, 40ULL * static_cast<unsigned>(n - 1)});
    CHECK(rtp::backward_traffic(n, 40) == rtp::pass_traffic{2 * (n - 1), 80ULL * static_cast<unsigned>(n - 1)});
  }
}

TEST_CASE(
    "rotation: each forward kernel sees the shard it is told, and evaluation leaves the owned shard bit-unchanged") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<std::vector<int>> order(static_cast<std::size_t>(n));
    std::vector<int> wrong(static_cast<std::size_t>(n), 0), displaced(static_cast<std::size_t>(n), 0);
    run_ranks(n, [&](in_process_communicator& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      rotation<in_process_communicator> rot(comm, elems);
      fill_owned(rot);
      const std::vector<float> before(rot.owned().begin(), rot.owned().end());
      for (int pass = 0; pass < 3; ++pass) {  // back-to-back evaluation passes
        rot.forward([&](int j, std::span<const float> w) {
          order[me].push_back(j);
          if (!holds_shard(w, j)) ++wrong[me];
        });
        if (!same_bits(rot.owned(), before)) ++displaced[me];
      }
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto me = static_cast<std::size_t>(r);
      CHECK(wrong[me] == 0);
      CHECK(displaced[me] == 0);
      REQUIRE(order[me].size() == static_cast<std::size_t>(3 * n));
      for (int s = 0; s < 3 * n; ++s) CHECK(order[me][static_cast<std::size_t>(s)] == rtp::forward_shard(r, n, s % n));
    }
  }
}

TEST_CASE("rotation: backward brings each shard's gradient home summed over all ranks, in the documented order") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<std::vector<float>> grads(static_cast<std::size_t>(n));
    std::vector<std::vector<int>> order(static_cast<std::size_t>(n));
    std::vector<int> wrong(static_cast<std::size_t>(n), 0), dirty(static_cast<std::size_t>(n), 0),
        moved(static_cast<std::size_t>(n), 0);
    run_ranks(n, [&](in_process_communicator& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      rotation<in_process_communicator> rot(comm, elems);
      fill_owned(rot);
      const std::vector<float> before(rot.owned().begin(), rot.owned().end());
      for (int pass = 0; pass < 2; ++pass) {  // the second pass must not add to the first's result
        rot.forward([](int, std::span<const float>) {});
        rot.backward([&](int j, std::span<const float> w, std::span<float> g) {
          order[me].push_back(j);
          if (!holds_shard(w, j)) ++wrong[me];
          for (const float x : g) dirty[me] += x != 0.0f;  // handed over zeroed
          for (std::size_t i = 0; i < g.size(); ++i) g[i] += contribution(comm.rank(), j, i);
        });
        if (!same_bits(rot.owned(), before)) ++moved[me];
      }
      grads[me].assign(rot.owned_grad().begin(), rot.owned_grad().end());
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto me = static_cast<std::size_t>(r);
      CHECK(wrong[me] == 0);
      CHECK(dirty[me] == 0);
      CHECK(moved[me] == 0);
      REQUIRE(order[me].size() == static_cast<std::size_t>(2 * n));
      for (int t = 0; t < 2 * n; ++t) CHECK(order[me][static_cast<std::size_t>(t)] == rtp::backward_shard(r, n, t % n));
      // The sum for shard r, in float, in the order gradient_contributor gives (the owner last).
      std::vector<float> expected(elems);
      for (std::size_t i = 0; i < elems; ++i) {
        float acc = contribution(rtp::gradient_contributor(r, n, 0), r, i);
        for (int k = 1; k < n; ++k) acc += contribution(rtp::gradient_contributor(r, n, k), r, i);
        expected[i] = acc;
      }
      CHECK(same_bits(grads[me], expected));
    }
  }
}

TEST_CASE("rotation: rotations sharing one set of transit buffers give the bits of rotations with their own") {
  // A small and a large layer, alternately, twice over: the shared set is grown by the large one
  // and left dirty by each pass; every pass must still see its own shards and sum its own gradient.
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<std::vector<float>> own(static_cast<std::size_t>(n)), shared(static_cast<std::size_t>(n));
    std::vector<std::size_t> bytes(static_cast<std::size_t>(n));
    for (const bool share : {false, true})
      run_ranks(n, [&](in_process_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        rtp::transit_buffers<float> set;
        std::optional<rotation<in_process_communicator>> small, large;
        if (share) {
          small.emplace(comm, elems, set);
          large.emplace(comm, 3 * elems, set);
          bytes[me] = small->transient_bytes();
        } else {
          small.emplace(comm, elems);
          large.emplace(comm, 3 * elems);
        }
        fill_owned(*small);
        fill_owned(*large);
        auto& out = share ? shared[me] : own[me];
        for (int pass = 0; pass < 2; ++pass)
          for (auto* rot : {&*small, &*large}) {
            rot->forward([&](int j, std::span<const float> w) { CHECK(holds_shard(w, j)); });
            rot->backward([&](int j, std::span<const float> w, std::span<float> g) {
              CHECK(holds_shard(w, j));
              for (std::size_t i = 0; i < g.size(); ++i)
                g[i] += contribution(comm.rank(), j, i) * static_cast<float>(pass + 1);
            });
            out.insert(out.end(), rot->owned_grad().begin(), rot->owned_grad().end());
          }
      });
    for (int r = 0; r < n; ++r) {
      const auto me = static_cast<std::size_t>(r);
      CHECK(same_bits(own[me], shared[me]));
      // One set of five buffers (the scratch alone with one rank) of the larger shard.
      CHECK(bytes[me] == (n > 1 ? 5u : 1u) * 3 * elems * sizeof(float));
    }
  }
}

TEST_CASE(
    "rotation with an external shard: load and store at the documented points, the bits of a rotation that holds it") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<std::vector<float>> own(static_cast<std::size_t>(n)), ext(static_cast<std::size_t>(n));
    std::vector<int> loads_fwd(static_cast<std::size_t>(n)), loads_bwd(static_cast<std::size_t>(n)),
        stores(static_cast<std::size_t>(n)), wrong(static_cast<std::size_t>(n)),
        after_throw(static_cast<std::size_t>(n));
    for (const bool external : {false, true})
      run_ranks(n, [&](in_process_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        rtp::transit_buffers<float> set;
        std::vector<float> mine(elems), sum;
        for (std::size_t i = 0; i < elems; ++i) mine[i] = weight_value(comm.rank(), i);
        const auto kernel = [&](int j, std::span<const float> w, std::span<float> g) {
          if (!holds_shard(w, j)) ++wrong[me];
          for (std::size_t i = 0; i < g.size(); ++i) g[i] += contribution(comm.rank(), j, i);
        };
        auto& out = external ? ext[me] : own[me];
        if (!external) {
          rotation<in_process_communicator> rot(comm, elems);
          fill_owned(rot);
          rot.forward([&](int j, std::span<const float> w) { wrong[me] += !holds_shard(w, j); });
          rot.backward(kernel);
          out.assign(rot.owned_grad().begin(), rot.owned_grad().end());
          return;
        }
        rotation<in_process_communicator> rot(comm, elems, set, rtp::external_shard);
        CHECK(rot.owned().empty());
        CHECK_THROWS_AS(rot.forward([](int, std::span<const float>) {}), state_error);
        int phase = 0;  // 0 forward, 1 backward, 2 not counted
        const auto load = [&](std::span<float> dst) {
          if (phase < 2) ++(phase == 0 ? loads_fwd : loads_bwd)[me];
          std::copy(mine.begin(), mine.end(), dst.begin());
        };
        rot.forward(load, [&](int j, std::span<const float> w) { wrong[me] += !holds_shard(w, j); });
        phase = 1;
        rot.backward(load, kernel, [&](std::span<const float> g) {
          ++stores[me];
          out.assign(g.begin(), g.end());
        });
        // A throwing kernel: the store is never called (one rank alone, so nobody waits on it).
        if (n == 1) {
          phase = 2;
          CHECK_THROWS_AS(
              rot.backward(
                  load, [](int, std::span<const float>, std::span<float>) { throw std::runtime_error("k"); },
                  [&](std::span<const float>) { ++after_throw[me]; }),
              std::runtime_error);
        }
      });
    for (int r = 0; r < n; ++r) {
      const auto me = static_cast<std::size_t>(r);
      CHECK(wrong[me] == 0);
      CHECK(same_bits(own[me], ext[me]));
      CHECK(loads_fwd[me] == 1);
      CHECK(loads_bwd[me] == (n == 1 ? 1 : 2));  // the first fetch and the last step
      CHECK(stores[me] == 1);
      CHECK(after_throw[me] == 0);
    }
  }
}

TEST_CASE(
    "rotation: every shift starts before a kernel and is waited for after it; send and receive buffers are distinct") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<ring_log> logs(static_cast<std::size_t>(n));
    std::vector<ring_log> fwd_logs(static_cast<std::size_t>(n));
    run_ranks(n, [&](in_process_communicator& inner) {
      const auto me = static_cast<std::size_t>(inner.rank());
      ring_log& log = logs[me];
      recording_ring comm(inner, log);
      rotation<recording_ring> rot(comm, elems);
      fill_owned(rot);
      rot.forward([&](int j, std::span<const float> w) { log.kernel(j, w.data(), nullptr, w.size_bytes()); });
      fwd_logs[me] = log;
      log = ring_log{};
      rot.backward([&](int j, std::span<const float> w, std::span<float> g) {
        log.kernel(j, w.data(), g.data(), w.size_bytes());
      });
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto me = static_cast<std::size_t>(r);
      for (const ring_log* log : {&fwd_logs[me], &logs[me]}) {
        for (const auto& v : log->violations) FAIL_CHECK(v);
        CHECK(log->in_flight.empty());
      }
      // Forward: start(s), kernel(s), wait(s) for each of the N - 1 shifts, then the last kernel.
      const ring_log& fwd = fwd_logs[me];
      CHECK(fwd.next_id == n - 1);
      std::vector<ring_log::event::kind_t> want;
      for (int s = 0; s < n; ++s) {
        if (s + 1 < n) want.push_back(ring_log::event::start);
        want.push_back(ring_log::event::kernel);
        if (s + 1 < n) want.push_back(ring_log::event::wait);
      }
      REQUIRE(fwd.events.size() == want.size());
      for (std::size_t e = 0; e < want.size(); ++e) CHECK(fwd.events[e].kind == want[e]);
      for (const int k : kernels_overlapping(fwd)) CHECK(k == 1);  // each shift spans exactly its step's kernel
      // Backward: 2(N - 1) shifts; the first (shard r - 1 for step 0) has no kernel to hide behind,
      // every other one spans exactly one kernel: weights during the step before theirs, a partial
      // gradient sum during the step that then adds to it.
      const ring_log& bwd = logs[me];
      CHECK(bwd.next_id == 2 * (n - 1));
      const auto spans = kernels_overlapping(bwd);
      for (std::size_t id = 0; id < spans.size(); ++id) {
        CAPTURE(id);
        CHECK(spans[id] == (id == 0 ? 0 : 1));
      }
      int kernels = 0;
      for (const auto& e : bwd.events) kernels += e.kind == ring_log::event::kernel;
      CHECK(kernels == n);
    }
  }
}

TEST_CASE("rotation: bytes per pass are (N-1) shards forward and (N-1)(shard + gradient) backward, by comm_stats") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<comm_stats> fwd(static_cast<std::size_t>(n)), bwd(static_cast<std::size_t>(n)),
        rep(static_cast<std::size_t>(n));
    run_ranks(n, [&](in_process_communicator& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      rotation<in_process_communicator> rot(comm, elems);
      const comm_stats s0 = comm.stats();
      rot.forward([](int, std::span<const float>) {});
      const comm_stats s1 = comm.stats();
      rot.backward([](int, std::span<const float>, std::span<float>) {});
      const comm_stats s2 = comm.stats();
      std::vector<float> replicated(5, 1.0f);
      rtp::reduce_replicated_grads(comm, std::span<float>(replicated));
      const comm_stats s3 = comm.stats();
      fwd[me] = {s1.bytes_sent - s0.bytes_sent, s1.bytes_received - s0.bytes_received, s1.collectives - s0.collectives};
      bwd[me] = {s2.bytes_sent - s1.bytes_sent, s2.bytes_received - s1.bytes_received, s2.collectives - s1.collectives};
      rep[me] = {s3.bytes_sent - s2.bytes_sent, s3.bytes_received - s2.bytes_received, s3.collectives - s2.collectives};
    });
    const std::uint64_t shard = elems * sizeof(float), hops = static_cast<std::uint64_t>(n - 1);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto me = static_cast<std::size_t>(r);
      CHECK(fwd[me].bytes_sent == hops * shard);
      CHECK(fwd[me].bytes_received == hops * shard);
      CHECK(fwd[me].collectives == hops);
      CHECK(bwd[me].bytes_sent == hops * (shard + shard));
      CHECK(bwd[me].bytes_received == hops * (shard + shard));
      CHECK(bwd[me].collectives == 2 * hops);
      CHECK(fwd[me].bytes_sent == rtp::forward_traffic(n, shard).bytes_sent);
      CHECK(bwd[me].bytes_sent == rtp::backward_traffic(n, shard).bytes_sent);
      // The replicated sum: an all-reduce of 5 floats ((N-1) x 20 bytes each way), none with one rank.
      CHECK(rep[me].bytes_sent == hops * 5 * sizeof(float));
      CHECK(rep[me].collectives == (n > 1 ? 1U : 0U));
    }
  }
}

TEST_CASE("rotation stats: shifts and bytes per pass match comm_stats; wait time is >= 0, and 0 with one rank") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    struct seen {
      rtp::rotation_stats fwd, bwd, reset, again;
      std::uint64_t comm_sent = 0;
    };
    std::vector<seen> got(static_cast<std::size_t>(n));
    run_ranks(n, [&](in_process_communicator& comm) {
      seen& me = got[static_cast<std::size_t>(comm.rank())];
      rotation<in_process_communicator> rot(comm, elems);
      const comm_stats s0 = comm.stats();
      rot.forward([](int, std::span<const float>) {});
      me.fwd = rot.stats();
      rot.backward([](int, std::span<const float>, std::span<float>) {});
      me.bwd = rot.stats();  // cumulative: forward + backward
      me.comm_sent = comm.stats().bytes_sent - s0.bytes_sent;
      rot.reset_stats();
      me.reset = rot.stats();
      rot.forward([](int, std::span<const float>) {});
      me.again = rot.stats();
    });
    const std::uint64_t shard = elems * sizeof(float), hops = static_cast<std::uint64_t>(n - 1);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const seen& me = got[static_cast<std::size_t>(r)];
      CHECK(me.fwd.shifts == hops);
      CHECK(me.fwd.bytes_sent == hops * shard);
      CHECK(me.bwd.shifts == 3 * hops);  // backward adds 2(N - 1)
      CHECK(me.bwd.bytes_sent == 3 * hops * shard);
      CHECK(me.bwd.bytes_sent == me.comm_sent);
      CHECK(me.fwd.wait_s >= 0.0);
      CHECK(me.bwd.wait_s >= me.fwd.wait_s);
      if (n == 1) CHECK(me.bwd.wait_s == 0.0);
      CHECK(me.reset.shifts == 0);
      CHECK(me.reset.bytes_sent == 0);
      CHECK(me.reset.wait_s == 0.0);
      CHECK(me.again.shifts == hops);
      CHECK(me.again.bytes_sent == hops * shard);
    }
  }
}

TEST_CASE("reduce_replicated_grads: every rank ends with the rank-order sum, bit for bit") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<std::vector<float>> got(static_cast<std::size_t>(n)), got_async(static_cast<std::size_t>(n));
    std::vector<std::vector<double>> got64(static_cast<std::size_t>(n));
    run_ranks(n, [&](in_process_communicator& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      std::vector<float> g(elems), h(elems);
      std::vector<double> d(elems);
      for (std::size_t i = 0; i < elems; ++i) {
        g[i] = h[i] = contribution(comm.rank(), 0, i);
        d[i] = 0.1 * (comm.rank() + 1) + static_cast<double>(i);
      }
      rtp::reduce_replicated_grads(comm, std::span<float>(g));
      rtp::reduce_replicated_grads(comm, std::span<double>(d));
      comm_handle pending = rtp::reduce_replicated_grads_async(comm, std::span<float>(h));
      pending.wait();
      got[me] = g;
      got_async[me] = h;
      got64[me] = d;
    });
    std::vector<float> expected(elems);
    for (std::size_t i = 0; i < elems; ++i) {
      float acc = contribution(0, 0, i);
      for (int k = 1; k < n; ++k) acc += contribution(k, 0, i);
      expected[i] = acc;
    }
    for (int r = 0; r < n; ++r) {
      CHECK(same_bits(got[static_cast<std::size_t>(r)], expected));
      CHECK(same_bits(got_async[static_cast<std::size_t>(r)], expected));
      CHECK(got64[static_cast<std::size_t>(r)] == got64[0]);
    }
  }
}

TEST_CASE("rotation faults: a kernel that throws on one rank gives its peers communication_error, not a hang") {
  // The failing rank's owned shard and gradient are as before the failed pass, its shifts are all
  // waited for; its peers find the group poisoned at their next shift.
  for (const int n : {2, 3, 4}) {
    for (const bool in_backward : {false, true}) {
      for (int fail_step = 0; fail_step < n; ++fail_step) {
        CAPTURE(n);
        CAPTURE(in_backward);
        CAPTURE(fail_step);
        const int victim = n - 1;
        std::vector<std::string> outcome(static_cast<std::size_t>(n));
        std::vector<int> intact(static_cast<std::size_t>(n), -1);
        CHECK_THROWS_AS(
            run_ranks(n,
                      [&](in_process_communicator& comm) {
                        const auto me = static_cast<std::size_t>(comm.rank());
                        rotation<in_process_communicator> rot(comm, elems);
                        fill_owned(rot);
                        auto fwd = [&](int, std::span<const float>) {};
                        auto bwd = [&](int j, std::span<const float>, std::span<float> g) {
                          for (std::size_t i = 0; i < g.size(); ++i) g[i] += contribution(comm.rank(), j, i);
                        };
                        rot.forward(fwd);
                        rot.backward(bwd);  // a gradient to keep intact
                        const std::vector<float> w0(rot.owned().begin(), rot.owned().end());
                        const std::vector<float> g0(rot.owned_grad().begin(), rot.owned_grad().end());
                        int step = 0;
                        auto failing_fwd = [&](int j, std::span<const float> w) {
                          if (comm.rank() == victim && !in_backward && step == fail_step) throw injected_error();
                          ++step;
                          fwd(j, w);
                        };
                        auto failing_bwd = [&](int j, std::span<const float> w, std::span<float> g) {
                          if (comm.rank() == victim && in_backward && step == fail_step) throw injected_error();
                          ++step;
                          bwd(j, w, g);
                        };
                        try {
                          for (int it = 0; it < 3; ++it) {  // peers keep training until the error reaches them
                            step = 0;
                            rot.forward(failing_fwd);
                            step = 0;
                            rot.backward(failing_bwd);
                          }
                          outcome[me] = "finished";
                        } catch (const injected_error&) {
                          outcome[me] = "injected";
                          intact[me] = same_bits(rot.owned(), w0) && same_bits(rot.owned_grad(), g0) ? 1 : 0;
                          throw;
                        } catch (const communication_error&) {
                          outcome[me] = "communication_error";
                        }
                      }),
            injected_error);
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          CHECK(outcome[static_cast<std::size_t>(r)] == (r == victim ? "injected" : "communication_error"));
        }
        CHECK(intact[static_cast<std::size_t>(victim)] == 1);
      }
    }
  }
}

TEST_CASE(
    "rotation faults: a communicator failing at any shift, at the call or in flight, leaves the owned buffers intact") {
  // One rank of a scripted 3-ring whose shifts land when waited for. For each shift of a
  // forward + backward, fail it (at the call, then in flight): the pass throws
  // communication_error, nothing is left in flight, the owned shard and gradient are unchanged,
  // and the same object then runs both passes to the result of a run without faults.
  auto run_passes = [](rotation<scripted_ring>& rot) {
    rot.forward([](int, std::span<const float>) {});
    rot.backward([](int j, std::span<const float> w, std::span<float> g) {
      for (std::size_t i = 0; i < g.size(); ++i) g[i] += w[i] * 0.5f + contribution(0, j, i);
    });
  };
  scripted_ring clean_ring(3);
  rotation<scripted_ring> clean(clean_ring, elems);
  fill_owned(clean);
  run_passes(clean);
  const int total = clean_ring.shifts;
  CHECK(total == 2 + 4);  // N - 1 forward, 2(N - 1) backward
  for (const bool in_wait : {false, true})
    for (int k = 0; k < total; ++k) {
      CAPTURE(in_wait);
      CAPTURE(k);
      scripted_ring ring(3);
      rotation<scripted_ring> rot(ring, elems);
      fill_owned(rot);
      std::fill(rot.owned_grad().begin(), rot.owned_grad().end(), -1.5f);
      const std::vector<float> w0(rot.owned().begin(), rot.owned().end());
      const std::vector<float> g0(rot.owned_grad().begin(), rot.owned_grad().end());
      ring.fail_at = k;
      ring.fail_in_wait = in_wait;
      CHECK_THROWS_AS(run_passes(rot), communication_error);
      CHECK(ring.outstanding == 0);
      // The stats count the shifts that were issued: all but a call that threw.
      CHECK(rot.stats().shifts == static_cast<std::uint64_t>(in_wait ? ring.shifts : ring.shifts - 1));
      CHECK(rot.stats().bytes_sent == rot.stats().shifts * rot.shard_bytes());
      CHECK(same_bits(rot.owned(), w0));
      CHECK(same_bits(rot.owned_grad(), g0));
      ring.fail_at = -1;
      run_passes(rot);
      CHECK(ring.outstanding == 0);
      CHECK(same_bits(rot.owned(), clean.owned()));
      CHECK(same_bits(rot.owned_grad(), clean.owned_grad()));
    }
}

TEST_CASE("rotation faults: one rank retries after a throwing kernel and gets the result of a clean run") {
  single_process_communicator comm;
  auto bwd = [](int j, std::span<const float> w, std::span<float> g) {
    for (std::size_t i = 0; i < g.size(); ++i) g[i] += 2.0f * w[i] + contribution(0, j, i);
  };
  rotation<single_process_communicator> clean(comm, elems);
  fill_owned(clean);
  clean.backward(bwd);
  rotation<single_process_communicator> rot(comm, elems);
  fill_owned(rot);
  const std::vector<float> g0(rot.owned_grad().begin(), rot.owned_grad().end());
  CHECK_THROWS_AS(rot.backward([](int, std::span<const float>, std::span<float> g) {
    g[0] = 99.0f;  // a partial write before the throw must not reach owned_grad
    throw injected_error();
  }),
                  injected_error);
  CHECK(same_bits(rot.owned_grad(), g0));
  CHECK_THROWS_AS(rot.forward([](int, std::span<const float>) { throw injected_error(); }), injected_error);
  rot.backward(bwd);
  CHECK(same_bits(rot.owned_grad(), clean.owned_grad()));
  CHECK(same_bits(rot.owned(), clean.owned()));
}

TEST_CASE(
    "rotation: a kernel that starts a pass on its own schedule gets state_error; an empty shard is a config_error") {
  single_process_communicator comm;
  rotation<single_process_communicator> rot(comm, elems);
  fill_owned(rot);
  CHECK_THROWS_AS(rot.forward([&](int, std::span<const float>) { rot.forward([](int, std::span<const float>) {}); }),
                  state_error);
  CHECK_THROWS_AS(rot.backward([&](int, std::span<const float>, std::span<float>) {
    rot.forward([](int, std::span<const float>) {});
  }),
                  state_error);
  int calls = 0;
  rot.forward([&](int j, std::span<const float> w) { calls += j == 0 && holds_shard(w, 0); });  // usable again
  CHECK(calls == 1);
  CHECK_THROWS_AS(rotation<single_process_communicator>(comm, 0), config_error);
  CHECK(rot.shard_bytes() == elems * sizeof(float));
  CHECK(rot.transient_bytes() == elems * sizeof(float));  // one rank: the scratch only
  in_process_group group(2);
  rotation<in_process_communicator> two(group.communicator(0), elems);  // construction issues no collective
  CHECK(two.transient_bytes() == 5 * elems * sizeof(float));
}

namespace {

/** Buffer operations on a "stream" that runs only when settled, as a device stream's work may run
 *  any time before its wait: the rotation's fills, sums and copies, and the test's kernels, queue
 *  on it. A shift started before settling would send or overwrite a buffer too early. */
struct deferred_ops {
  static constexpr bool host_memory = false;
  struct stream {
    std::vector<std::function<void()>> work;
    int settles = 0;
  };
  std::shared_ptr<stream> s = std::make_shared<stream>();
  void zero(float* p, std::size_t n) const {
    s->work.emplace_back([=] { std::fill(p, p + n, 0.0f); });
  }
  void add(float* acc, const float* x, std::size_t n) const {
    s->work.emplace_back([=] {
      for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
    });
  }
  void copy(float* d, const float* x, std::size_t n) const {
    s->work.emplace_back([=] { std::copy(x, x + n, d); });
  }
  void settle() const {
    ++s->settles;
    auto w = std::move(s->work);
    s->work.clear();
    for (auto& f : w) f();
  }
};
static_assert(rtp::BufferOps<deferred_ops, float>);

}  // namespace

TEST_CASE(
    "rotation on buffers whose operations run only when settled: the host bits, a settle before every shift, a failed "
    "pass settles") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<std::vector<float>> host(static_cast<std::size_t>(n)), deferred(static_cast<std::size_t>(n));
    std::vector<int> wrong(static_cast<std::size_t>(n)), settles(static_cast<std::size_t>(n));
    for (const bool defer : {false, true})
      run_ranks(n, [&](in_process_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        std::vector<float> mine(elems);
        for (std::size_t i = 0; i < elems; ++i) mine[i] = weight_value(comm.rank(), i);
        rtp::transit_buffers<float> set;
        auto& out = defer ? deferred[me] : host[me];
        const auto run = [&](auto& rot, auto enqueue) {
          const auto load = [&](std::span<float> dst) {
            enqueue([&mine, dst] { std::copy(mine.begin(), mine.end(), dst.begin()); });
          };
          rot.forward(
              load, [&](int j, std::span<const float> w) { enqueue([&, j, w] { wrong[me] += !holds_shard(w, j); }); });
          rot.backward(
              load,
              [&](int j, std::span<const float> w, std::span<float> g) {
                enqueue([&, j, w, g] {
                  wrong[me] += !holds_shard(w, j);
                  for (std::size_t i = 0; i < g.size(); ++i) g[i] += contribution(comm.rank(), j, i);
                });
              },
              [&](std::span<const float> sum) { enqueue([&out, sum] { out.assign(sum.begin(), sum.end()); }); });
        };
        if (!defer) {
          rotation<in_process_communicator> rot(comm, elems, set, rtp::external_shard);
          run(rot, [](auto f) { f(); });
          return;
        }
        deferred_ops ops;
        rotation<in_process_communicator, float, deferred_ops> rot(comm, elems, set, rtp::external_shard, ops);
        run(rot, [&](auto f) { ops.s->work.emplace_back(f); });
        ops.settle();  // the caller's wait before reading the result
        settles[me] = ops.s->settles - 1;
        if (n == 1) {  // a kernel that queues work and throws: the pass settles before it returns
          CHECK_THROWS_AS(rot.backward([&](std::span<float> d) { ops.copy(d.data(), mine.data(), elems); },
                                       [&](int, std::span<const float>, std::span<float> g) {
                                         ops.zero(g.data(), g.size());
                                         throw std::runtime_error("kernel");
                                       },
                                       [](std::span<const float>) {}),
                          std::runtime_error);
          CHECK(ops.s->work.empty());
        }
      });
    for (int r = 0; r < n; ++r) {
      const auto me = static_cast<std::size_t>(r);
      CHECK(wrong[me] == 0);
      CHECK(!deferred[me].empty());
      CHECK(same_bits(host[me], deferred[me]));
      CHECK(settles[me] == 3 * (n - 1));  // one per shift: forward N - 1, backward 2 (N - 1)
    }
  }
}

}  // namespace rtp_schedule_test
