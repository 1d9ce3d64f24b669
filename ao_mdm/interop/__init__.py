"""The authors' PyTorch code: the import of their checkpoints (`torch_import.py`) and a PyTorch
AO-GPT with their parameter names (`torch_reference.py`), the oracle of the tests."""
