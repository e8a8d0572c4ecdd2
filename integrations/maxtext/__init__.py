"""MaxText 0.2.5 under jax-elastic (see docs/maxtext.md).

::

    from integrations.maxtext import load_maxtext_config, make_job
    elastic_config, maxtext_config = load_maxtext_config("my_model.yml", ["steps=100"])
    report = make_job(elastic_config, maxtext_config).fit()

Needs MaxText and its dependencies (``integrations/maxtext/requirements.txt``);
importing this package does not import MaxText or JAX, the functions do.
"""

from integrations.maxtext.config import MAXTEXT_VERSION, load_maxtext_config
from integrations.maxtext.data import SyntheticSource
from integrations.maxtext.model import make_job

__all__ = ["MAXTEXT_VERSION", "SyntheticSource", "load_maxtext_config", "make_job"]
