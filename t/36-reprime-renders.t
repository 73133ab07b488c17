#!/usr/bin/perl

# What the re-prime renders (reprime.c), on the fake backend, whose model
# nginx cannot read (memory "unknown": every save re-primes): the turn's
# request, the reply as the client will send it back, and the next turn,
# once with "1" and once with "2".  After a reply with tool calls the next
# turn is their results ("tool" messages with the calls' ids), as a
# client sends them; a reply's reasoning goes into both renders when the
# history shows the client sends reasoning back, into neither when it
# shows it does not, and into the second only when the history has no
# earlier reply to tell (the two renders' common prefix then stops before
# it).  The real templates' figures are in t/39-templates.t and
# t/92-reprime.t; the rig's random weights write no tool call.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 1);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    location => 'add_header X-S-Action $llama_session_action always;'));

my $json = JSON::PP->new->canonical;

# the reply the fake gives a chat request (not the re-prime's completion)
sub script_reply {
    my ($message) = @_;
    $t->fake_script({ completion => {
        match => '"messages"',
        reply => { choices => [ { index => 0, finish_reason => 'stop',
                                  message => $message } ] } } });
}

sub turn {
    my ($sid, $msgs) = @_;
    my $r = $t->post('/v1/chat/completions', { messages => $msgs },
                     headers => { 'X-Session-Id' => $sid });
    is($r->{status}, 200, "$sid: 200") or diag $r->{content};
    return $r;
}

# the messages of the re-prime's two renders since the call n
sub renders {
    my ($from) = @_;
    my @calls = @{ $t->fake_calls };
    return map { $json->decode($_->{body})->{messages} }
           grep { $_->{path} eq '/apply-template' }
           @calls[$from .. $#calls];
}

# another session takes the slot: the one there is re-primed and saved
sub swap_out {
    my ($who) = @_;
    my $n = scalar @{ $t->fake_calls };
    script_reply({ role => 'assistant', content => 'ok' });
    turn("other-$who", [ { role => 'user', content => "I am other $who." } ]);
    my @r = renders($n);
    is(scalar @r, 2, "$who: re-primed, two renders");
    return @r;
}

my $call = { id => 'call_7', type => 'function',
             function => { name => 'note', arguments => '{"n":"a"}' } };

# a reply with a tool call: its result follows it in the renders
{
    my $msgs = [ { role => 'user', content => 'Read note a.' } ];
    script_reply({ role => 'assistant', content => '',
                   tool_calls => [ $call ] });
    my $r = turn('tools', $msgs);
    is($r->{json}{choices}[0]{message}{tool_calls}[0]{id}, 'call_7',
       'tools: the reply calls a tool');
    my ($one, $two) = swap_out('tools');
    is($one->[-2]{role}, 'assistant', 'tools: the reply before the next turn');
    is($one->[-2]{tool_calls}[0]{id}, 'call_7', 'tools: with its tool call');
    is_deeply($one->[-1], { role => 'tool', tool_call_id => 'call_7',
                            content => '1' },
              "tools: the next turn is the call's result, not a user's");
    is_deeply($two->[-1], { role => 'tool', tool_call_id => 'call_7',
                            content => '2' },
              'tools: the second render the same with "2"');
    is(scalar @$one, 3, 'tools: request, reply, result');
}

# a first reply with reasoning: the history cannot tell whether the client
# sends it back: the first render without, the second with
{
    script_reply({ role => 'assistant', content => 'Fine.',
                   reasoning_content => 'Let me think.' });
    turn('think', [ { role => 'user', content => 'How are you?' } ]);
    my ($one, $two) = swap_out('think');
    is($one->[-2]{content}, 'Fine.', 'first return: the reply in both');
    ok(!exists $one->[-2]{reasoning_content},
       'first return: the first render without its reasoning');
    is($two->[-2]{reasoning_content}, 'Let me think.',
       'first return: the second with it');
    is_deeply($one->[-1], { role => 'user', content => '1' },
              'first return: then a user message');
}

# a client that sends reasoning back: both renders have it
{
    script_reply({ role => 'assistant', content => 'Again.',
                   reasoning_content => 'Once more.' });
    turn('back', [ { role => 'user', content => 'How are you?' },
                   { role => 'assistant', content => 'Fine.',
                     reasoning_content => 'Let me think.' },
                   { role => 'user', content => 'And now?' } ]);
    my ($one, $two) = swap_out('back');
    is($one->[-2]{reasoning_content}, 'Once more.',
       'reasoning sent back: the first render has it');
    is($two->[-2]{reasoning_content}, 'Once more.',
       'reasoning sent back: the second too');
}

# a client that sends none back: neither has it
{
    script_reply({ role => 'assistant', content => 'Again.',
                   reasoning_content => 'Once more.' });
    turn('plain', [ { role => 'user', content => 'How are you?' },
                    { role => 'assistant', content => 'Fine.' },
                    { role => 'user', content => 'And now?' } ]);
    my ($one, $two) = swap_out('plain');
    ok(!exists $one->[-2]{reasoning_content} && !exists $two->[-2]{reasoning_content},
       'reasoning not sent back: neither render has it');
    is($one->[-2]{content}, 'Again.', 'reasoning not sent back: the reply');
}

# a turn with an image: saved as the slot holds it (a render writes the
# media as text, and its tokens would cut the slot at the first image)
{
    script_reply({ role => 'assistant', content => 'A cat.' });
    turn('pic', [ { role => 'user', content => [
                      { type => 'image_url', image_url =>
                          { url => 'data:image/png;base64,iVBORw0KGgo=' } },
                      { type => 'text', text => 'What is this?' } ] } ]);
    my $n = scalar @{ $t->fake_calls };
    script_reply({ role => 'assistant', content => 'ok' });
    turn('other-pic', [ { role => 'user', content => 'I am other pic.' } ]);
    is(scalar(renders($n)), 0, 'media: no render');
    ok($t->wait_for(sub { $t->log_lines(qr/the last turn of "pic-\w+" holds an image, audio or a file: its slot is saved as it is/) }, 5),
       'media: saved as the slot holds it, said at info');
}

ok(!$t->log_lines(qr/saved without a re-prime/), 'no re-prime failed');
ok(scalar $t->log_lines(qr/re-primed "tools-\w+"/), 'the tool call\'s re-primed');

$t->stop;
done_testing;
