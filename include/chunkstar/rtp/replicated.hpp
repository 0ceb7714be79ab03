// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `reduce_replicated_grads`: the gradients of the parameters RTP does not shard (norm
 *         gains and biases, an output bias) summed over all ranks, so the replicas stay equal.
 *
 *  Every rank holds these parameters whole and computes their gradient from its own micro-batch
 *  only; without this all-reduce the replicas drift apart from the first step (the reference
 *  implementation never synchronises them). The sum matches what `rotation::backward` gives the
 *  sharded weights: the gradient of the sum of the ranks' losses. The communicators reduce in
 *  rank order, so every rank gets the same bits and the result is deterministic.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>

#include <span>

namespace chunkstar::rtp {

/** @brief Replaces @p grads on every rank with their sum over the ranks of @p comm. Every rank
 *  calls it with the same number of elements (it is a collective, issued even for none, so a rank
 *  that disagrees is caught by the communicator rather than shifting every later call). Throws `communication_error`
 *  if the collective fails; @p grads is then unspecified. */
template <Communicator Comm>
void reduce_replicated_grads(Comm& comm, std::span<float> grads) {
  if (comm.size() == 1) return;  // nothing to add; keeps one rank free of collectives
  comm.allreduce(grads.data(), grads.size(), dtype::f32, reduce_op::sum);
}

/** @brief The same over doubles. */
template <Communicator Comm>
void reduce_replicated_grads(Comm& comm, std::span<double> grads) {
  if (comm.size() == 1) return;
  comm.allreduce(grads, reduce_op::sum);
}

/** @brief Starts the sum of `reduce_replicated_grads` and returns its handle, so it can overlap the
 *  rest of backward; @p grads must stay alive and untouched until the handle is waited for. */
template <Communicator Comm>
[[nodiscard]] comm_handle reduce_replicated_grads_async(Comm& comm, std::span<float> grads) {
  if (comm.size() == 1) return {};
  return comm.allreduce_async(grads.data(), grads.size(), dtype::f32, reduce_op::sum);
}

}  // namespace chunkstar::rtp
