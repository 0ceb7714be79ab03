# SPDX-License-Identifier: Apache-2.0
# Runs train_gpt briefly and checks, from its output, that (1) the loss falls and (2) resuming from
# a checkpoint continues the exact trajectory of an uninterrupted run.
#   cmake -DTRAIN=<train_gpt> -DWORK=<dir> -P train_short.cmake
set(args --preset tiny --batch 4 --seq 64 --steps 24 --warmup 4 --lr 3e-3 --val-every 0 --sample 32
         --chunk-elems 16384 --device-budget auto)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

function(run out)
  execute_process(COMMAND ${TRAIN} ${args} ${ARGN} OUTPUT_VARIABLE o ERROR_VARIABLE e RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_gpt ${ARGN} failed (${rc}):\n${o}\n${e}")
  endif()
  set(${out} "${o}" PARENT_SCOPE)
endfunction()

# Step lines "step     7/24 | loss 5.123456 | ..." -> list of "7=5.123456".
function(losses text out)
  string(REGEX MATCHALL "step +[0-9]+/[0-9]+ \\| loss [0-9.]+" lines "${text}")
  set(result)
  foreach(l IN LISTS lines)
    string(REGEX REPLACE "step +([0-9]+)/[0-9]+ \\| loss ([0-9.]+)" "\\1=\\2" kv "${l}")
    list(APPEND result "${kv}")
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

run(full)
message("${full}")
losses("${full}" all)
list(LENGTH all n)
if(NOT n EQUAL 24)
  message(FATAL_ERROR "expected 24 step lines, got ${n}")
endif()
# The loss must fall: the mean of the last 4 steps below the mean of the first 4, by a margin.
set(first 0)
set(last 0)
foreach(i 0 1 2 3)
  list(GET all ${i} kv)
  string(REGEX REPLACE ".*=" "" v "${kv}")
  math(EXPR j "${n} - 1 - ${i}")
  list(GET all ${j} kv2)
  string(REGEX REPLACE ".*=" "" w "${kv2}")
  set(first "${first} + ${v}")
  set(last "${last} + ${w}")
endforeach()
execute_process(COMMAND awk "BEGIN { a = (${first}) / 4; b = (${last}) / 4; print (b < a - 0.3) ? \"ok\" : \"no\", a, b }"
                OUTPUT_VARIABLE verdict)
message("loss (mean of first 4 -> last 4 steps): ${verdict}")
if(NOT verdict MATCHES "^ok")
  message(FATAL_ERROR "the loss did not fall: ${verdict}")
endif()
if(NOT full MATCHES "sample:")
  message(FATAL_ERROR "no sample printed")
endif()

# Interrupt at step 10 with a checkpoint, resume, and compare steps 11..24 with the full run.
run(part --stop-after 10 --save "${WORK}/ckpt")
run(resumed --resume "${WORK}/ckpt")
losses("${resumed}" cont)
list(SUBLIST all 10 14 expected)
if(NOT "${cont}" STREQUAL "${expected}")
  message(FATAL_ERROR "resumed trajectory differs:\n  expected ${expected}\n  got      ${cont}")
endif()
message("resume continues the same trajectory: ${cont}")
