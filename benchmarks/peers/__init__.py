"""Peer engines (vLLM, llama.cpp) for the side-by-side benchmarks: setup.sh, runners, servers."""
