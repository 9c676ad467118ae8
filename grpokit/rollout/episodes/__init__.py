"""Multi-turn episodes: environments and tools (env.py), tool-call parsing (parse.py), the token
layer (chat.py) and the turn loop over any rollout engine (runner.py). docs/agents.md."""

from grpokit.rollout.episodes.env import EnvSpec, FunctionEnv, ToolPool, load_object
from grpokit.rollout.episodes.runner import EpisodeRunner, EpisodeSettings, episode_metrics

__all__ = ["EnvSpec", "EpisodeRunner", "EpisodeSettings", "FunctionEnv", "ToolPool", "episode_metrics", "load_object"]
