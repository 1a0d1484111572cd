"""Rewards: the registry and the ``reward.*`` section (``registry``), the math reward (``math_reward``,
with its answer formats in ``answers``), and the code reward: the sandbox that runs model-written
programs (``sandbox``), the runner inside it (``code_runner``), scoring (``code``) and coding data
(``code_data``)."""
