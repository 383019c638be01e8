"""Inference runtime: KV-cache generation for paratrain's Llama (single process or tensor parallel)."""
