// SPDX-License-Identifier: Apache-2.0
// How a train_gpt run ends when something fails: one message (naming the rank in a parallel run)
// and an exit code that says what kind of failure it was (--help lists them), at once.
#pragma once

#include "preflight.hpp"
#include "train_options.hpp"

#include <chunkstar/core/error.hpp>

#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <string_view>
#include <system_error>

namespace gpt {

/** Writing an output failed while the run was under way (exit code 4: the input was fine). */
struct output_error : chunkstar::error {
  using chunkstar::error::error;
};

inline int process_rank = 0;  // for messages: every rank of a parallel run prints its own errors

/** Ends the process now with @p code after printing @p message: no destructor or atexit handler
 *  runs, so a BLAS worker stuck in its allocator (or any other thread) cannot keep a failed run
 *  alive. Checkpoints are written atomically, so nothing on disk is half-done. */
[[noreturn]] inline void fatal(int code, const std::string& message) {
  std::fflush(stdout);
  if (process_rank > 0) std::fprintf(stderr, "error (rank %d): %s\n", process_rank, message.c_str());
  else std::fprintf(stderr, "error: %s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(code);
}

/** Runs @p f (given the phase it is in, to name in a message, which it advances) and ends the
 *  process through `fatal` with the exit code of whatever it throws. */
template <class F>
int run_guarded(const train_options& o, F&& f) {
  using namespace chunkstar;
  const char* phase = "checking the options";
  try {
    return f(phase);
  } catch (const output_error& e) {
    fatal(exit_io, e.what());
  } catch (const out_of_memory_error& e) {
    const std::string what = e.what();  // the preflight's own message names the limit already
    fatal(exit_out_of_memory, std::string("out of memory while ") + phase +
                                  (what.find("ulimit -v") == std::string::npos ? address_space_note() : "") + ": " +
                                  what);
  } catch (const config_error& e) {
    fatal(exit_bad_input, e.what());
  } catch (const checkpoint_error& e) {  // the checkpoint to resume
    fatal(exit_bad_input, e.what());
  } catch (const io_error& e) {  // reading --data or a bad --disk-dir before training; the disk tier failing during it
    if (std::string_view(phase) == "training" && !o.disk_dir.empty())
      fatal(exit_io,
            std::string(
                "the disk tier failed while training (chunks in memory are intact; the last checkpoint is too): ") +
                e.what());
    fatal(exit_bad_input, e.what());
  } catch (const communication_error& e) {
    fatal(exit_internal, std::string("communication between the ranks failed while ") + phase + ": " + e.what());
  } catch (const chunkstar::error& e) {
    fatal(exit_internal, std::string("internal error while ") + phase + " (please report it): " + e.what());
  } catch (const std::bad_alloc&) {
    fatal(exit_out_of_memory, std::string("out of host memory while ") + phase + address_space_note() +
                                  ": lower --batch, --seq or the model size, or raise the process's memory limit");
  } catch (const std::system_error& e) {
    const bool resource =
        e.code() == std::errc::resource_unavailable_try_again || e.code() == std::errc::not_enough_memory;
    fatal(resource ? exit_out_of_memory : exit_io,
          std::string(resource ? "out of resources while " : "a system call failed while ") + phase + ": " + e.what() +
              (resource ? " (a thread or buffer could not be created; check ulimit -v and ulimit -u)" : ""));
  } catch (const std::exception& e) {
    fatal(exit_internal, std::string("unexpected error while ") + phase + " (please report it): " + e.what());
  }
}

inline constexpr const char* exit_codes_help =
    "Exit status: 0 success; 1 internal error (a bug: please report it); 2 bad input (an option, the --data file, or "
    "the "
    "checkpoint to --resume: the message names it and what to do); 3 out of memory (a memory space, the host, or a "
    "resource limit such as ulimit -v; a memory report follows the message); 4 writing an output (--save, --trace) "
    "failed "
    "during the run.\n"
    "Checkpoints (--save DIR): written atomically into a temporary directory beside DIR and swapped into place, under "
    "an "
    "advisory lock on DIR.lock, so concurrent writers take turns and a crash leaves the previous checkpoint; DIR is "
    "replaced only if it is empty or a chunkstar checkpoint. Every option and output path is checked before training "
    "starts; --resume compares the checkpoint's configuration with the options and names each difference "
    "(--allow-change lets the listed ones change).";

}  // namespace gpt
