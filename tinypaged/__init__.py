"""tinypaged: a small LLM serving engine, built stage by stage.

The public API mirrors vLLM on purpose: ``LLM``, ``SamplingParams``, ``LLM.generate``.
"""

from tinypaged import triton_mode  # noqa: F401  (must come first: sets TRITON_INTERPRET)

__version__ = "0.1.0"

from tinypaged.config import EngineConfig  # noqa: E402
from tinypaged.llm import LLM  # noqa: E402
from tinypaged.engine.llm_engine import LLMEngine  # noqa: E402
from tinypaged.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tinypaged.sampling_params import BeamSearchParams, SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput"]
