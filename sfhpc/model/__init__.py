"""The policy model: the project's own small Llama-architecture model, saved in Hugging Face format."""
