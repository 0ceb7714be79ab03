// SPDX-License-Identifier: Apache-2.0
// The scripted copy engine (tests/support/scripted_copy_engine.hpp) is itself a model of the
// CopyEngine concept that the component tests lean on, so its own contract is proved first:
// nothing runs until released, lanes are FIFO and independent, barriers hold a lane, waits never
// deadlock (they finish the job and count a stall), faults throw before anything is queued.
#include "support/scripted_copy_engine.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cstring>
#include <vector>

using namespace chunkstar;
using namespace chunkstar::testing;

namespace scripted_copy_engine_test {

namespace {
std::array<int, 4> block(int base) { return {base, base + 1, base + 2, base + 3}; }
}  // namespace

TEST_CASE("scripted engine: copies run only when released, in order per lane, lanes independent") {
  scripted_copy_engine e;
  auto a = block(10), b = block(20), c = block(30);
  std::array<int, 4> da{}, db{}, dc{};
  const auto ha = e.copy_async(da.data(), a.data(), sizeof a, copy_direction::to_device);
  const auto hb = e.copy_async(db.data(), b.data(), sizeof b, copy_direction::to_device);
  const auto hc = e.copy_async(dc.data(), c.data(), sizeof c, copy_direction::to_host);
  CHECK(!ha.ready());
  CHECK(!hb.ready());
  CHECK(!hc.ready());
  CHECK(da == std::array<int, 4>{});
  CHECK(e.queued(copy_direction::to_device) == 2);
  CHECK(e.queued() == 3);

  CHECK(e.release_next(copy_direction::to_host));  // another lane first: independent
  CHECK(hc.ready());
  CHECK(dc == c);
  CHECK(!ha.ready());
  CHECK(e.release_next(copy_direction::to_device));  // FIFO: a before b
  CHECK(ha.ready());
  CHECK(!hb.ready());
  CHECK(da == a);
  CHECK(e.release_next(copy_direction::to_device));
  CHECK(db == b);
  CHECK(!e.release_next(copy_direction::to_device));  // empty lane
  CHECK(e.stalls().empty());

  const auto ops = e.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops[0].kind == scripted_op_kind::copy_async);
  CHECK(ops[0].lane == copy_direction::to_device);
  CHECK(ops[0].dst == da.data());
  CHECK(ops[0].src == a.data());
  CHECK(ops[0].bytes == sizeof a);
  CHECK(ops[0].handle == ha.id());
  CHECK(ops[2].handle == hc.id());
  const auto st = e.stats();
  CHECK(st[copy_direction::to_device].copies == 2);
  CHECK(st[copy_direction::to_device].bytes == 2 * sizeof a);
  CHECK(st[copy_direction::to_host].copies == 1);
}

TEST_CASE("scripted engine: order_after holds a lane until the handle finishes") {
  scripted_copy_engine e;
  auto a = block(1), b = block(2);
  std::array<int, 4> da{}, db{};
  const auto evict = e.copy_async(da.data(), a.data(), sizeof a, copy_direction::to_host);
  e.order_after(evict, copy_direction::to_device);
  const auto load = e.copy_async(db.data(), b.data(), sizeof b, copy_direction::to_device);
  CHECK(e.blocked(copy_direction::to_device));
  CHECK(!e.release_next(copy_direction::to_device));
  CHECK(!load.ready());
  CHECK(e.release_next(copy_direction::to_host));
  CHECK(!e.blocked(copy_direction::to_device));
  CHECK(e.release_next(copy_direction::to_device));
  CHECK(db == b);
  const auto ops = e.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops[1].kind == scripted_op_kind::order_after);
  CHECK(ops[1].lane == copy_direction::to_device);
  CHECK(ops[1].handle == evict.id());

  // An empty or finished handle orders nothing, but the call is recorded.
  e.order_after(scripted_copy_handle{}, copy_direction::to_device);
  e.order_after(evict, copy_direction::to_device);
  CHECK(!e.blocked(copy_direction::to_device));
  CHECK(e.ops().size() == 5);
  CHECK(e.ops()[3].handle == 0);
}

TEST_CASE("scripted engine: record(stream) gives a handle the test completes; barriers on it hold") {
  scripted_copy_engine e;
  const scripted_stream s{3};
  const auto user = e.record(s);
  CHECK(!user.ready());
  CHECK(e.ops().back().kind == scripted_op_kind::record);
  CHECK(e.ops().back().stream == 3);
  CHECK(e.ops().back().handle == user.id());
  auto a = block(5);
  std::array<int, 4> d{};
  e.order_after(user, copy_direction::to_host);
  const auto h = e.copy_async(d.data(), a.data(), sizeof a, copy_direction::to_host);
  CHECK(e.release_all() == 0);  // release_all leaves user work alone
  CHECK(!h.ready());
  CHECK(e.user_handles(s).size() == 1);
  e.complete(user);
  CHECK(user.ready());
  CHECK(e.release_all() == 1);
  CHECK(d == a);
  // complete_stream completes every handle recorded on that stream only.
  const auto u1 = e.record(s), u2 = e.record(s), other = e.record(scripted_stream{4});
  e.complete_stream(s);
  CHECK(u1.ready());
  CHECK(u2.ready());
  CHECK(!other.ready());
  CHECK_THROWS_AS(e.complete(h), std::logic_error);  // a queued job is released, not completed
}

TEST_CASE("scripted engine: wait() on an unfinished job finishes it (and what is ahead) and records a stall") {
  scripted_copy_engine e;
  std::vector<std::uint64_t> seen;
  e.on_stall = [&](std::uint64_t id) { seen.push_back(id); };
  const scripted_stream s{1};
  const auto user = e.record(s);
  auto a = block(1), b = block(2), c = block(3);
  std::array<int, 4> da{}, db{}, dc{};
  e.order_after(user, copy_direction::to_host);
  const auto ha = e.copy_async(da.data(), a.data(), sizeof a, copy_direction::to_host);
  e.order_after(ha, copy_direction::to_device);
  const auto hb = e.copy_async(db.data(), b.data(), sizeof b, copy_direction::to_device);
  const auto hc = e.copy_async(dc.data(), c.data(), sizeof c, copy_direction::to_device);
  hb.wait();  // through the barrier on ha, which waits for the user's work
  CHECK(hb.ready());
  CHECK(ha.ready());
  CHECK(user.ready());
  CHECK(!hc.ready());  // behind b: not needed
  CHECK(da == a);
  CHECK(db == b);
  CHECK(e.stalls() == std::vector<std::uint64_t>{hb.id()});
  CHECK(seen == e.stalls());
  hb.wait();  // finished: no second stall
  CHECK(e.stalls().size() == 1);
  scripted_copy_handle{}.wait();  // an empty handle returns at once
  CHECK(e.stalls().size() == 1);
}

TEST_CASE("scripted engine: failed jobs rethrow from wait; injected faults throw before queueing") {
  scripted_copy_engine e;
  auto a = block(7);
  std::array<int, 4> d{};
  const auto h = e.copy_async(d.data(), a.data(), sizeof a, copy_direction::to_device);
  CHECK(e.fail_next(copy_direction::to_device, "link down"));
  CHECK(h.ready());
  CHECK_THROWS_AS(h.wait(), chunkstar::error);
  CHECK(d == std::array<int, 4>{});  // nothing copied
  CHECK(e.stats()[copy_direction::to_device].copies == 0);

  e.throw_on(scripted_op_kind::copy_async, 2);
  const auto first = e.copy_async(d.data(), a.data(), sizeof a, copy_direction::to_device);
  CHECK_THROWS_AS((void)e.copy_async(d.data(), a.data(), sizeof a, copy_direction::to_device), scripted_fault);
  CHECK(e.ops().back().threw);
  CHECK(e.queued(copy_direction::to_device) == 1);                              // only the first
  (void)e.copy_async(d.data(), a.data(), sizeof a, copy_direction::to_device);  // the fault fired once
  CHECK(e.queued(copy_direction::to_device) == 2);
  e.throw_on(scripted_op_kind::order_after);
  CHECK_THROWS_AS(e.order_after(first, copy_direction::to_host), scripted_fault);
  CHECK(!e.blocked(copy_direction::to_host));
  e.throw_on(scripted_op_kind::zero_async);
  CHECK_THROWS_AS((void)e.zero_async(d.data(), sizeof d), scripted_fault);
  e.throw_on(scripted_op_kind::record);
  CHECK_THROWS_AS((void)e.record(scripted_stream{}), scripted_fault);
}

TEST_CASE("scripted engine: zero_async on the local lane; copy and synchronize finish without stalls") {
  scripted_copy_engine e;
  std::array<int, 4> d = block(9);
  const auto z = e.zero_async(d.data(), sizeof d);
  CHECK(e.ops().back().lane == copy_direction::host_to_host);
  CHECK(d == block(9));
  CHECK(e.release_next(copy_direction::host_to_host));
  CHECK(z.ready());
  CHECK(d == std::array<int, 4>{});
  CHECK(e.stats().total_bytes() == 0);  // a fill is not a transfer

  auto a = block(4);
  std::array<int, 4> d1{}, d2{};
  const auto queued = e.copy_async(d1.data(), a.data(), sizeof a, copy_direction::to_host);
  e.copy(d2.data(), a.data(), sizeof a, copy_direction::to_host);  // ordered behind `queued`
  CHECK(queued.ready());
  CHECK(d2 == a);
  const auto user = e.record(scripted_stream{2});
  e.order_after(user, copy_direction::to_device);
  const auto blocked = e.copy_async(d1.data(), d2.data(), sizeof a, copy_direction::to_device);
  e.synchronize();  // finishes everything, user work included
  CHECK(blocked.ready());
  CHECK(user.ready());
  CHECK(e.stalls().empty());
  CHECK(e.ops().back().kind == scripted_op_kind::synchronize);
}

}  // namespace scripted_copy_engine_test
