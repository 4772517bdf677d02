"""Model adapters for the fusion executor (transformers now; SGLang's can live beside)."""
