// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `communicator_ref`: a non-owning, type-erased reference to any `Communicator`, itself a
 *         `Communicator`. For the edges of a program where the transport is a run-time choice (one
 *         process or MPI ranks, from a command-line flag) and instantiating the runtime once per
 *         transport would only cost compile time: a collective moves a whole chunk, so one indirect
 *         call per collective costs nothing measurable.
 */
#pragma once

#include <chunkstar/comm/blocking_collectives.hpp>
#include <chunkstar/comm/communicator.hpp>

#include <cstddef>
#include <span>

namespace chunkstar {

/** @brief Refers to a communicator that outlives it; copyable, cheap. */
class communicator_ref : public blocking_collectives<communicator_ref> {
 public:
  template <Communicator C>
  requires(!std::same_as<C, communicator_ref>) communicator_ref(C& c)
  noexcept : obj_(&c), vt_(&vtable_for<C>) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] int rank() const { return vt_->rank(obj_); }
  [[nodiscard]] int size() const { return vt_->size(obj_); }
  void barrier() { vt_->barrier(obj_); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    return vt_->allreduce(obj_, p, n, t, op);
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return vt_->allreduce_f64(obj_, d, op); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) { return vt_->allgather(obj_, s, r, n); }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    return vt_->reduce_scatter(obj_, s, r, n, t, op);
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    return vt_->reduce(obj_, s, r, n, t, op, root);
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) { return vt_->broadcast(obj_, p, n, root); }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) { return vt_->ring_shift(obj_, s, r, n); }
  /** @brief The referred communicator's byte counts (zeros if it keeps none). */
  [[nodiscard]] comm_stats stats() const { return vt_->stats(obj_); }

 private:
  struct vtable {
    int (*rank)(const void*);
    int (*size)(const void*);
    void (*barrier)(void*);
    comm_handle (*allreduce)(void*, void*, std::size_t, dtype, reduce_op);
    comm_handle (*allreduce_f64)(void*, std::span<double>, reduce_op);
    comm_handle (*allgather)(void*, const void*, void*, std::size_t);
    comm_handle (*reduce_scatter)(void*, const void*, void*, std::size_t, dtype, reduce_op);
    comm_handle (*reduce)(void*, const void*, void*, std::size_t, dtype, reduce_op, int);
    comm_handle (*broadcast)(void*, void*, std::size_t, int);
    comm_handle (*ring_shift)(void*, const void*, void*, std::size_t);
    comm_stats (*stats)(const void*);
  };
  template <class C>
  static constexpr vtable vtable_for{
      [](const void* o) { return static_cast<const C*>(o)->rank(); },
      [](const void* o) { return static_cast<const C*>(o)->size(); },
      [](void* o) { static_cast<C*>(o)->barrier(); },
      [](void* o, void* p, std::size_t n, dtype t, reduce_op op) {
        return static_cast<C*>(o)->allreduce_async(p, n, t, op);
      },
      [](void* o, std::span<double> d, reduce_op op) { return static_cast<C*>(o)->allreduce_async(d, op); },
      [](void* o, const void* s, void* r, std::size_t n) { return static_cast<C*>(o)->allgather_async(s, r, n); },
      [](void* o, const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
        return static_cast<C*>(o)->reduce_scatter_async(s, r, n, t, op);
      },
      [](void* o, const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
        return static_cast<C*>(o)->reduce_async(s, r, n, t, op, root);
      },
      [](void* o, void* p, std::size_t n, int root) { return static_cast<C*>(o)->broadcast_async(p, n, root); },
      [](void* o, const void* s, void* r, std::size_t n) { return static_cast<C*>(o)->ring_shift_async(s, r, n); },
      [](const void* o) -> comm_stats {
        if constexpr (requires(const C& c) { c.stats(); }) return static_cast<const C*>(o)->stats();
        else return {};
      },
  };
  void* obj_;
  const vtable* vt_;
};

static_assert(Communicator<communicator_ref>);

}  // namespace chunkstar
