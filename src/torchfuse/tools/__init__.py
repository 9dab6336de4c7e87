"""Developer tools: the OpInfo sweep (`python -m torchfuse.tools.opinfo_sweep`) and the random
program fuzzer (`python -m torchfuse.tools.fuzz`).  Both compare torchfuse against eager PyTorch."""
