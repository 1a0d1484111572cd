"""Rewards beyond the math verifier's registry (``rollout.rewards``): the math reward's answer formats
(``answers``), and the code reward: the sandbox that runs model-written programs (``sandbox``), the
runner inside it (``code_runner``), scoring (``code``) and coding data (``code_data``)."""
