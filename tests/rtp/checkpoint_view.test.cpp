// SPDX-License-Identifier: Apache-2.0
// The RTP checkpoint views (rtp/checkpoint_view.hpp) on a model that is not the GPT: a weight pair
// split over the ranks (rtp/weight_pair.hpp) and a replicated vector, its lists in host vectors.
// Saved at N ranks and loaded at M, every rank's buffers hold exactly the values of the whole
// tensors, whatever N and M: the views need nothing from a model but ShardedModel.
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/rtp/checkpoint_view.hpp>
#include <chunkstar/rtp/weight_pair.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "support/disk_test_dir.hpp"

namespace checkpoint_view_test {

using namespace chunkstar;

/** A's (8 x 6) rows and bias and B's (5 x 8) columns split over the ranks, and c (5) replicated. */
class pair_model {
 public:
  explicit pair_model(int world, int rank)
      : pair_(rtp::make_weight_pair(6, 8, 5, world, "units")), rank_(static_cast<std::size_t>(rank)) {
    specs_ = {{"a.w", {8, 6}, dtype::f32, tensor_role::weight},
              {"a.b", {8}, dtype::f32, tensor_role::bias},
              {"b.w", {5, 8}, dtype::f32, tensor_role::weight},
              {"c", {5}, dtype::f32, tensor_role::other}};
    parts_.resize(2);
    parts_[0].elems = pair_.shard_elems();
    parts_[0].for_each = [this](const auto& f) {
      pair_.for_each(rank_, [&](rtp::weight_pair::part p, std::size_t i, std::size_t off) {
        f(static_cast<std::size_t>(p), i, off);
      });
    };
    parts_[0].segments = {{pair_.a_weight_offset(), pair_.a_bias_offset(), 0},
                          {pair_.a_bias_offset(), pair_.b_weight_offset(), 1},
                          {pair_.b_weight_offset(), pair_.shard_elems(), 2}};
    parts_[1].elems = 5;
    parts_[1].replicated = true;
    parts_[1].for_each = [](const auto& f) {
      for (std::size_t i = 0; i < 5; ++i) f(3, i, i);
    };
    parts_[1].segments = {{0, 5, 3}};
    for (std::size_t k = 0; k < 2; ++k)
      for (auto& l : lists_[k]) l.assign(parts_[k].elems, 0.0f);
  }
  [[nodiscard]] std::span<const tensor_spec> specs() const noexcept { return specs_; }
  [[nodiscard]] std::span<const rtp::model_part> parts() const noexcept { return parts_; }
  void read(std::size_t k, chunk_kind kind, std::span<float> out) const {
    const auto& l = lists_.at(k)[slot(kind)];
    std::copy(l.begin(), l.end(), out.begin());
  }
  void write(std::size_t k, chunk_kind kind, std::span<const float> in) {
    auto& l = lists_.at(k)[slot(kind)];
    std::copy(in.begin(), in.end(), l.begin());
  }

  /** Element i of tensor t in list kind, as every rank count must see it. */
  static float value(std::size_t t, std::size_t i, chunk_kind kind) {
    return std::sin(0.7f * static_cast<float>(i) + 1.9f * static_cast<float>(t) + 0.3f * static_cast<float>(kind));
  }
  void fill() {
    for (std::size_t k = 0; k < 2; ++k)
      for (const auto kind : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance})
        parts_[k].for_each(
            [&](std::size_t t, std::size_t i, std::size_t off) { lists_[k][slot(kind)][off] = value(t, i, kind); });
  }
  /** Elements that differ from value(): 0 after a faithful load. */
  [[nodiscard]] std::size_t wrong() const {
    std::size_t n = 0;
    for (std::size_t k = 0; k < 2; ++k)
      for (const auto kind : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance})
        parts_[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) {
          const float want = value(t, i, kind), got = lists_[k][slot(kind)][off];
          n += std::memcmp(&want, &got, sizeof want) != 0;
        });
    return n;
  }

 private:
  static std::size_t slot(chunk_kind k) { return k == chunk_kind::momentum ? 1 : k == chunk_kind::variance ? 2 : 0; }
  rtp::weight_pair pair_;
  std::size_t rank_;
  std::vector<tensor_spec> specs_;
  std::vector<rtp::model_part> parts_;
  std::array<std::array<std::vector<float>, 3>, 2> lists_;
};

static_assert(rtp::ShardedModel<pair_model>);

TEST_CASE(
    "RTP checkpoint views: a non-GPT model saved at N ranks loads at M ranks with every element's bits, N, M in 1, 2, "
    "4") {
  for (const int n : {1, 2, 4})
    for (const int m : {1, 2, 4}) {
      CAPTURE(n);
      CAPTURE(m);
      chunkstar::test::scratch_dir dir;
      const std::string ck = dir.path() + "/ck";
      run_ranks(n, [&](in_process_communicator& comm) {
        pair_model model(comm.size(), comm.rank());
        model.fill();
        rtp::checkpoint_save_view view(model, comm);
        save_checkpoint(view, ck);
      });
      std::vector<std::size_t> wrong(static_cast<std::size_t>(m));
      run_ranks(m, [&](in_process_communicator& comm) {
        pair_model model(comm.size(), comm.rank());
        rtp::checkpoint_load_view view(model);
        (void)load_checkpoint(view, ck);
        wrong[static_cast<std::size_t>(comm.rank())] = model.wrong();
      });
      for (const std::size_t w : wrong) CHECK(w == 0);
    }
}

}  // namespace checkpoint_view_test
