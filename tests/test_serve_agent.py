"""An agent framework from PyPI (langchain-openai) against `kvrun serve` on the default model
(SmolLM2-135M): a two-tool task through the framework's own tool binding and its tool-message
loop. The agent looks an account number up with one tool, passes it to the other, and answers.

The model is too small to pick tools under tool_choice "auto", so each step names its tool
(tool_choice as langchain passes a tool's name); the arguments are the model's, held to each
tool's schema by the server's grammar, and checked here against the tools' own pydantic models
(which refuse unknown keys) after langchain parsed them."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.slow  # a server process

ACCOUNTS = {"alice": "AC-4471", "bob": "AC-9120"}
BALANCES = {"AC-4471": "1,250.00 EUR", "AC-9120": "80.15 EUR"}


class OwnerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    owner: str = Field(description="the customer's first name", max_length=20)


class AccountArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    account: str = Field(description="an account number", pattern=r"^AC-[0-9]{4}$")


@tool(args_schema=OwnerArgs)
def find_account(owner: str) -> str:
    """The account number of a customer, by the customer's first name."""
    return ACCOUNTS.get(owner.strip().lower(), "unknown customer")


@tool(args_schema=AccountArgs)
def get_balance(account: str) -> str:
    """The balance of an account, by its account number (such as AC-1234)."""
    return BALANCES.get(account, "no such account")


TOOLS = {t.name: t for t in (find_account, get_balance)}
SCHEMAS = {"find_account": OwnerArgs, "get_balance": AccountArgs}


@pytest.fixture(scope="module")
def server(default_gguf):
    from test_serve import Served

    s = Served(default_gguf, "-np", "2")
    yield s
    s.stop()


def run_tools(ai: AIMessage) -> list[ToolMessage]:
    """The framework's tool loop: each parsed call checked against its tool's schema, then
    run by the tool, whose ToolMessage carries the call's id back."""
    out = []
    for call in ai.tool_calls:
        SCHEMAS[call["name"]].model_validate(call["args"])  # unknown keys, bad pattern: fail
        msg = TOOLS[call["name"]].invoke(call)
        assert isinstance(msg, ToolMessage) and msg.tool_call_id == call["id"]
        out.append(msg)
    return out


def test_two_tool_task(server):
    """find_account, then get_balance with its result (the second step streamed: langchain
    joins the tool-call deltas), then a plain answer."""
    llm = ChatOpenAI(model="smollm2", base_url=server.url, api_key="none", temperature=0,
                     max_tokens=120, max_retries=0, timeout=300)  # fmt: skip
    tools = list(TOOLS.values())
    msgs: list = [HumanMessage("What is the balance of Alice's account? Find her account first.")]

    ai = llm.bind_tools(tools, tool_choice="find_account").invoke(msgs)
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    (call,) = ai.tool_calls
    assert call["name"] == "find_account" and call["id"].startswith("call_")
    msgs += [ai, *run_tools(ai)]
    assert msgs[-1].content in ACCOUNTS.values(), msgs[-1].content  # it named a customer

    chunks = list(llm.bind_tools(tools, tool_choice="get_balance").stream(msgs))
    ai = chunks[0]
    for c in chunks[1:]:
        ai += c
    (call,) = ai.tool_calls
    assert call["name"] == "get_balance"
    assert call["args"] == {"account": msgs[-1].content}  # the first tool's answer, passed on
    msgs += [ai, *run_tools(ai)]
    assert msgs[-1].content in BALANCES.values()

    # the answer: the model has the balance in its context (a tool message) and no tools
    msgs.append(HumanMessage("Now answer my question in one sentence."))
    final = llm.invoke(msgs)
    assert final.response_metadata["finish_reason"] == "stop"
    assert not final.tool_calls and final.content.strip()
    # the answer comes from the second tool's result (greedy: the same text on the packed
    # and the dense weights, "The answer to the question is: 1,250.00 EUR")
    assert "1,250.00" in final.content, final.content
