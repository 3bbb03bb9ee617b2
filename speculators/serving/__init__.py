"""vLLM: the engine set-up every engine and server here shares, multi-node layouts, the `serve` command."""
