"""DP aggregation at the output: members that each see a disjoint part of a document collection,
decoded in lockstep with a public sequence; every step's token is chosen by a DP mechanism
(``privacy.aggregation``). Unit: one document. No vLLM import (``serving.aggregate`` drives vLLM).
"""

from .decode import Aggregator, Step, TopLogprobs, generate
from .documents import Collection, Document, load_collection

__all__ = ["Aggregator", "Collection", "Document", "Step", "TopLogprobs", "generate", "load_collection"]
