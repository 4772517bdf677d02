"""An SGLang external model package (`SGLANG_EXTERNAL_MODEL_PACKAGE`) for the fusion gate's test:
a model class fusion's registry serves through its MRO but whose forward the adapter does not
reproduce, as a user's own architecture derived from SGLang's Llama would be."""
