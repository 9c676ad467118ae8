"""Multi-turn episodes: environments and tools (env.py), tool-call parsing (parse.py), the token
layer (chat.py), the turn loop over any rollout engine (runner.py), its metrics (metrics.py), and
agent loops users own (custom.py). docs/agents.md."""

from grpokit.rollout.episodes.custom import EngineHandle, LoopRunner, Sampled, Trajectory
from grpokit.rollout.episodes.env import EnvSpec, FunctionEnv, ToolPool, load_object
from grpokit.rollout.episodes.metrics import episode_metrics
from grpokit.rollout.episodes.runner import EpisodeRunner, EpisodeSettings

__all__ = ["EngineHandle", "EnvSpec", "EpisodeRunner", "EpisodeSettings", "FunctionEnv", "LoopRunner", "Sampled",
           "ToolPool", "Trajectory", "episode_metrics", "load_object"]
