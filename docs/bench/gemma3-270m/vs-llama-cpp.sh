#!/bin/bash
# Plain greedy decoding of Gemma 3 270M Q4_K_M: verispec against llama.cpp, same prompts, same thread count, interleaved.
F=/work/ext/gemma/gemma3-270m.gguf; L=/work/ext/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
V=/work/main/.venv/bin/verispec
for t in 1 2; do
 for p in "def fibonacci(n):" "import numpy as np" "class Stack:"; do
  for rep in 1 2; do
   printf '%s' "$p" > /tmp/gp.txt
   env -u OMP_WAIT_POLICY $L/llama-completion -m $F --binary-file /tmp/gp.txt --no-escape -n 128 -c 4096 -t $t -tb $t --temp 0 --ignore-eos -no-cnv --no-display-prompt 2>&1 | grep -E "eval time" | grep -v prompt | sed "s/^/llama t=$t [$p] /"
   $V generate --target $F --method autoregressive --max-new-tokens 128 --ignore-eos --threads $t "$p" 2>/dev/null | grep -E "tok/s" | sed "s/^/ours  t=$t [$p] /"
  done
 done
done
