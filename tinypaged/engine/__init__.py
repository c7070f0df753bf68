"""The engine: ``LLMEngine`` walks one step (input -> schedule -> execute -> sample -> output), with the input
and output processors, the detokenizer, the metrics and beam search around it (vLLM v1's ``v1/engine``)."""
