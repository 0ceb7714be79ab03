// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `step_agreement`: the arguments of one optimizer step (learning rate, micro-batches, the
 *         step's number, ...) checked alike on every rank in one sum-allreduce of host doubles
 *         (`run`), or inside one the caller makes anyway (`fill`, then `check`).
 *
 *  `require_agreement` (rank_agreement.hpp) compares the configuration once; a step's arguments
 *  may change every step (a schedule's lr), and ranks passing different ones would diverge
 *  silently. Each rank writes its values into slots of its own and zeros into the other ranks',
 *  so the sum holds every rank's values exactly (x + 0 is x) and every rank decides alike.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief One argument of a step, as a double (floats and integers below 2^53 are exact). */
struct step_argument {
  std::string_view name;
  double value = 0;
};

/** @brief Pure: in @p summed (rank-major: rank r's value of argument a at r x @p args + a), the first
 *  argument, then the first rank, whose value differs from rank 0's; nullopt when all agree. NaNs
 *  count as equal to each other. */
[[nodiscard]] inline std::optional<std::pair<std::size_t, int>> first_step_disagreement(std::span<const double> summed,
                                                                                        std::size_t args, int world) {
  for (std::size_t a = 0; a < args; ++a)
    for (int r = 1; r < world; ++r) {
      const double x = summed[static_cast<std::size_t>(r) * args + a], ref = summed[a];
      if (!(x == ref || (std::isnan(x) && std::isnan(ref)))) return std::pair{a, r};
    }
  return std::nullopt;
}

/** @brief This rank's step arguments and the slots they take in an allreduce (see the file comment). */
class step_agreement {
 public:
  /** @param what the call that checks ("chunk_adam::step"), for the error. */
  step_agreement(std::string_view what, std::vector<step_argument> args, int rank, int world)
      : what_(what), args_(std::move(args)), rank_(rank), world_(world) {}

  /** @brief Doubles it adds to an allreduce: arguments x ranks. */
  [[nodiscard]] std::size_t slots() const noexcept { return args_.size() * static_cast<std::size_t>(world_); }
  /** @brief This rank's values in its own slots, zeros in the others' (`out.size() == slots()`). */
  void fill(std::span<double> out) const noexcept {
    std::fill(out.begin(), out.end(), 0.0);
    for (std::size_t a = 0; a < args_.size(); ++a)
      out[static_cast<std::size_t>(rank_) * args_.size() + a] = args_[a].value;
  }
  /** @brief After the sum: returns where every rank passed the same values; else throws the same
   *  `config_error` on every rank, naming the argument, rank 0's value and the first differing rank's. */
  void check(std::span<const double> summed) const {
    const auto d = first_step_disagreement(summed, args_.size(), world_);
    if (!d) return;
    const auto [a, r] = *d;
    throw config_error(std::string(what_) + ": the ranks' step arguments differ: rank 0 passes " +
                       std::string(args_[a].name) + " " + text(summed[a]) + " but rank " + std::to_string(r) +
                       " passes " + std::string(args_[a].name) + " " +
                       text(summed[static_cast<std::size_t>(r) * args_.size() + a]) +
                       "; every rank must pass the same arguments at every step (the same schedule, batch split and "
                       "step count)");
  }
  /** @brief An allreduce of its own, for a step that makes none of host doubles. Collective. */
  template <Communicator C>
  void run(C& comm) const {
    std::vector<double> buffer(slots());
    fill(buffer);
    comm.allreduce(std::span<double>(buffer), reduce_op::sum);
    check(buffer);
  }

 private:
  /** As it was passed: a float's shortest text where the value is one ("0.01", not 0.00999...). */
  static std::string text(double v) {
    const auto f = static_cast<float>(v);
    return static_cast<double>(f) == v ? config_value(f) : config_value(v);
  }

  std::string_view what_;
  std::vector<step_argument> args_;
  int rank_ = 0, world_ = 1;
};

}  // namespace chunkstar
