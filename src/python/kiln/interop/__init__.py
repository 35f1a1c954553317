"""Hugging Face interop: a Kiln Llama as a `transformers` Llama folder, and back.

- `kiln.interop.export`: a checkpoint's parameters, LlamaConfig and tokenizer -> a folder that
  `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load as they are.
- `kiln.interop.read`: a Hugging Face Llama folder -> LlamaConfig and Kiln's parameter tree,
  refusing, with what differs, any model that is not a plain Llama.
- `kiln.interop.llama_config`, `kiln.interop.llama_weights`: the two mappings (hyper-parameters,
  parameter names and layouts); `kiln.interop.safetensors_folder`: sharded safetensors files.
- `kiln.interop.evaluate`: a Hugging Face Llama folder scored with a run's own lm-eval tasks
  and validation caches (the trainer's code, the run's metric names).

`python -m kiln.interop export|import|eval` runs them from the command line; docs/interop.md has
the mapping table and the conventions.
"""
