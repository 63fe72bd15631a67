"""The policy model's folder: what a Hugging Face folder must hold (`folder`), the small Hugging Face folders
sfhpc builds on the spot (`hf_folder`: a BPE tokenizer, a chat template, Qwen2 or Llama weights), the model a
recipe without ``model.path`` gets, built that way for its task (`tiny`), and its supervised warm start
(`warm_start`)."""
