// SPDX-License-Identifier: Apache-2.0
// doctest main for MPI tests: every rank runs the same suite (so collectives line up); rank 0
// reports in full, the others only their failures; the exit code fails if any rank failed; a rank
// that leaves a test case early ends the job on every rank (abort_on_leave).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chunkstar/mpi/mpi_communicator.hpp>

#include <cstdio>
#include <string>

namespace {

/** A rank that leaves a test case early (an exception, a failed REQUIRE) would leave the others
 *  blocked in that case's next collective until the CTest timeout: it ends the job on every rank
 *  at once instead, saying why (MPI_Abort; the exit code fails the test). */
struct abort_on_leave : doctest::IReporter {
  explicit abort_on_leave(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& t) override { name_ = t.m_name; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException& e) override { leave("threw", e.error_string.c_str()); }
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData& a) override {
    if (!a.m_failed || !(a.m_at & doctest::assertType::is_require)) return;
    const std::string where = std::string(a.m_file) + ":" + std::to_string(a.m_line) + ": REQUIRE(" + a.m_expr + ")";
    leave(where.c_str(), a.m_threw ? a.m_exception.c_str() : "failed");
  }
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}

 private:
  void leave(const char* what, const char* why) const {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::fflush(stdout);
    std::fprintf(stderr, "rank %d left test case \"%s\" early (%s: %s): aborting every rank\n", rank, name_, what, why);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  const char* name_ = "";
};
REGISTER_LISTENER("abort_on_leave", 1, abort_on_leave);

}  // namespace

int main(int argc, char** argv) {
  chunkstar::mpi_session session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  if (rank != 0) ctx.setOption("minimal", true);
  const int failed = ctx.run();
  if (ctx.shouldExit()) return failed;
  int any_failed = failed != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && failed == 0) std::printf("FAILED: another rank reported failures (see above)\n");
  return any_failed ? 1 : 0;
}
