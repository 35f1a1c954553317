"""The Llama model: config (kiln.model.config), layers (kiln.model.llama), attention dispatch."""
