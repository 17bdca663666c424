"""hstu: train, evaluate, generate with and serve HSTU generative recommenders.

HSTU: Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations", ICML 2024.
"""

__version__ = "0.1.0"
