"""Evaluation: offline acceptance and the lossless check (`evaluate`), the GuideLLM benchmark (`bench`, with
`guidellm`, `served`, `output_judge` and `bench_report`), the lossless judge's rule (`lossless`) and the
machine's load during speed runs (`machine_load`)."""
