"""tokenmill: an LLM inference engine where every technique is a switch you can measure."""
