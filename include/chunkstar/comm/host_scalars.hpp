// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Control-plane collectives on host memory built on `allreduce(std::span<double>)` alone:
 *         `broadcast_scalars` and `broadcast_string`.
 *
 *  A `Communicator`'s `void*` collectives move model data in the memory it serves, which for
 *  `nccl_communicator` is device memory: a host pointer there is an illegal address, not a slow
 *  path. The `span<double>` allreduce is the one collective every communicator performs on host
 *  memory, so whatever the library exchanges about the run rather than the model (configuration
 *  hashes, a checkpoint's directory, flags) goes through it. A broadcast is an allreduce in which
 *  every rank but the root contributes zeros: exact for any double (x + 0 = x; -0.0 comes back as
 *  +0.0), so integers below 2^53 and bytes travel unchanged.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace chunkstar {

/** @brief Collective: every rank's @p values become rank @p root's (every rank passes the same
 *  size). One allreduce of @p values.size() doubles. */
template <Communicator C>
void broadcast_scalars(C& comm, std::span<double> values, int root) {
  if (comm.size() <= 1) return;
  if (comm.rank() != root) std::fill(values.begin(), values.end(), 0.0);
  comm.allreduce(values, reduce_op::sum);
}

/** @brief Collective: rank @p root's @p s on every rank (other ranks' @p s is ignored). Two
 *  allreduces: the length, then the bytes, one double each. */
template <Communicator C>
[[nodiscard]] std::string broadcast_string(C& comm, const std::string& s, int root) {
  if (comm.size() <= 1) return s;
  double length = static_cast<double>(s.size());
  broadcast_scalars(comm, std::span<double>(&length, 1), root);
  std::vector<double> bytes(static_cast<std::size_t>(length), 0.0);
  if (comm.rank() == root)
    std::transform(s.begin(), s.end(), bytes.begin(),
                   [](char c) { return static_cast<double>(static_cast<unsigned char>(c)); });
  broadcast_scalars(comm, std::span<double>(bytes), root);
  std::string out(bytes.size(), '\0');
  std::transform(bytes.begin(), bytes.end(), out.begin(),
                 [](double b) { return static_cast<char>(static_cast<unsigned char>(b)); });
  return out;
}

}  // namespace chunkstar
