"""`placement="ray"`: every member in a Ray actor, the ensemble logic in the caller.

The modules: actor.py (`MemberActor`, in the Ray worker), handles.py (what the caller holds of an
actor's states, rows and byte LM), member.py (`RayMember`, the caller-side `TokenLM`),
placement.py (joining the cluster, `member_resources`, one actor per member).


`MemberActor` (one per member, in a Ray worker) holds the model, its KV states, the rows of
log-probs each forward produced and, for smc, the member's `ByteLM`. `RayMember` (in the caller)
implements the `TokenLM` protocol over it: tokenization, chat rendering and the vocabulary index
stay in the caller (a `TokenizerView` on the same tokenizer files), forwards and every
vocabulary-sized step run on the actor, and only small results cross the wire:

- a KV state is a handle (`RemoteState`) whose token ids the caller mirrors;
- a forward's log-prob rows stay on the actor (`RemoteRows` / `RemoteRow` handles); the methods
  ask them for what they need: the top-k (UniTE's union inputs), the values at given ids, the
  argmax, a sampled token (`members.rows`);
- in-line scoring returns one number per candidate token; smc's byte LM runs on the actor and
  returns 257-slot byte distributions per beam.

Calls are submitted without waiting (a Ray actor runs its calls in submission order) and the
caller only waits where it needs a value, so the forwards of different members run concurrently:
verifiers verify and SpecFuse members draft in parallel. Handles the caller drops are freed on
the actor with the next call. Payload bytes both ways are counted per member (`bytes_moved`).

Concurrent requests batch across the actors: the caller's step scheduler (members/scheduler.py)
sends a Ray member's step, the prompts or the extends and scorings of several requests, as one
call (`RayMember.run_batch`), and the actor runs it as one batched forward on its states
(`MemberActor.op_prefills` / `op_step`; prompts scored for per-request weights are items of the
prompt batch, and smc's byte LMs of several requests are one `op_bytelm_next_many` call). Each
request's forwards are counted on the actor under a handle of the request, so its stats stay its
own while others run beside it.

Faults: a dead actor (killed, out of memory) fails the request with a `GenerationError` naming
the member; Ray restarts it (`max_restarts`) and the next request runs on the fresh actor. The
caller waits in short slices and checks the request's deadline between them, so a timeout holds.
"""

from .member import RayMember
from .placement import check_member_resources, clear_actors, place_members

__all__ = ["RayMember", "check_member_resources", "clear_actors", "place_members"]
