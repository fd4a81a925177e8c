"""Speculative decoding: proposers draft tokens, the verifier accepts them against one target step.

Core side only (no torch in the proposers); one seam into EngineCore.step: a proposal in, accepted tokens out.
"""
from __future__ import annotations
