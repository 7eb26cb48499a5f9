"""Base models and what a payload may hold for them.

Owns the catalogue of base models (`catalog`), their tokenizer files (`tokenizers`), admission
by structure (`structure`) under the LoRA target names (`lora_names`), what each loss takes
(`losses`) and the admission checks and limits of training and sampling payloads
(`validation`). Pure Python, no torch: the API validates with it, the engine builds from it.

Imports the platform's top modules only; the API, the workers, `serving` and `operations` call
it.
"""
